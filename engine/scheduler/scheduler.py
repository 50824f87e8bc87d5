"""Token-budget scheduler: plain Python, no MLX.

Each step every decoding request computes one token, and prefilling requests
share a per-step prefill token budget, each taking at most one chunk (chunked
prefill), so a long prompt is spread over many steps and never freezes the
streams already running, while a burst of short prompts starts in few steps.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

from engine.config import EngineConfig
from engine.errors import QueueFullError, QueueTimeoutError
from engine.kv.cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.scheduler.output import DecodeRow, ExpiredRequest, NewRequest, PrefillChunk, SchedulerOutput


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        clock: Callable[[], float] = time.monotonic,
        kv: KVCacheManager | None = None,
    ) -> None:
        self.config = config
        self.kv = kv or KVCacheManager()
        self._clock = clock
        self.waiting: deque[Request] = deque()
        # Admitted requests (prefilling or decoding), in admission order.
        self.running: list[Request] = []
        self._freed_request_ids: list[str] = []
        # The last step's decode rows (the runner's decode batch), finished or not.
        self._decoding: dict[str, Request] = {}

    # ---- admission -------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request or refuse it with QueueFullError; never drop it silently."""
        total = len(self.waiting) + len(self.running)
        if total >= self.config.max_num_seqs:
            raise QueueFullError(
                f"The engine already holds {total} requests (max_num_seqs={self.config.max_num_seqs})"
            )
        if self.config.queue_size is not None and self._num_queued_beyond_free_slots() >= self.config.queue_size:
            raise QueueFullError(f"The request queue is full (queue_size={self.config.queue_size})")
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def _num_queued_beyond_free_slots(self) -> int:
        free_slots = self.config.max_decode_seqs - len(self.running)
        return max(0, len(self.waiting) - max(0, free_slots))

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """Mark finished (stopped, length, aborted, error); a running request's KV is freed next step."""
        if request.is_finished:
            return
        assert status.is_finished, status
        if request in self.running:
            self.running.remove(request)
            self._freed_request_ids.append(request.request_id)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.release(request)
        request.status = status

    # ---- scheduling ------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self.kv.begin_step()
        output = SchedulerOutput(freed_request_ids=self._freed_request_ids)
        self._freed_request_ids = []
        output.expired = self._expire_waiting()
        decoding = self._schedule_decodes()
        output.decode_rows = [
            DecodeRow(r.request_id, r.num_decode_steps - 1, self._draft_allowance(r)) for r in decoding.values()
        ]
        output.rows_to_cache = self._leaving_rows_to_cache(decoding)
        output.prefill_chunks = self._schedule_prefills(output.new_requests)
        return output

    def _draft_allowance(self, request: Request) -> int:
        """Drafts a row may verify this step: none past max_tokens (the scheduled token counts one)."""
        spec = self.config.speculative
        if spec is None or not request.speculative or request.guide is not None:
            return 0
        return max(0, min(spec.num_draft_tokens, request.max_tokens - request.num_decode_steps))

    def accept_drafts(self, accepted: dict[str, int]) -> None:
        """Rows of the last step that accepted drafts: those tokens are computed (in their KV) and sampled."""
        for request_id, count in accepted.items():
            request = self._decoding.get(request_id)
            if request is not None:
                request.num_computed_tokens += count
                request.num_decode_steps += count

    def uncached_prompts_may_be_hit(self) -> bool:
        """Whether the runner should copy the last step's completed prompts into the prefix cache before
        this step is scheduled (a waiting request may hit them)."""
        return self.kv.uncached_prompts_may_be_hit(self.waiting)

    def _expire_waiting(self) -> list[ExpiredRequest]:
        timeout = self.config.queue_timeout
        if timeout is None or not self.waiting:
            return []
        now = self._clock()
        expired = [r for r in self.waiting if now - r.arrival_time > timeout]
        for request in expired:
            request.error = QueueTimeoutError(
                f"Request waited {now - request.arrival_time:.1f}s in the queue (queue_timeout={timeout}s)"
            )
            self.finish_request(request, RequestStatus.FINISHED_ERROR)
        return [ExpiredRequest(r.request_id, r.error) for r in expired]

    def _schedule_decodes(self) -> dict[str, Request]:
        decodes: dict[str, Request] = {}
        for request in self.running:
            if request.is_prefilling or not request.wants_more_decode_steps:
                continue
            if len(decodes) == self.config.max_decode_seqs:
                break
            request.num_decode_steps += 1
            request.num_computed_tokens += 1
            decodes[request.request_id] = request
        return decodes

    def _leaving_rows_to_cache(self, decoding: dict[str, Request]) -> dict[str, tuple[int, ...]]:
        """Rows leaving the decode batch (finished, or at max_tokens with their last token in flight)
        whose KV the prefix cache keeps: prompt and generated tokens, so multi-turn chats hit them."""
        leaving = [r for rid, r in self._decoding.items() if rid not in decoding]
        self._decoding = decoding
        to_cache = {}
        for request in leaving:
            tokens = self.kv.tokens_to_cache(request)
            if tokens is not None:
                to_cache[request.request_id] = tokens
        return to_cache

    def _schedule_prefills(self, new_requests: list[NewRequest]) -> list[PrefillChunk]:
        budget = self.config.prefill_token_budget
        chunks: list[PrefillChunk] = []
        candidates = [r for r in self.running if r.is_prefilling]
        for request in candidates:
            if len(chunks) == self.config.max_prefill_seqs or budget == 0:
                return chunks
            budget = self._add_chunk(request, budget, chunks)
        while self.waiting and len(self.running) < self.config.max_decode_seqs:
            if len(chunks) == self.config.max_prefill_seqs or budget == 0:
                break
            request = self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self.kv.reuse_cached_prefix(request)
            new_requests.append(NewRequest(
                request.request_id, request.prompt_token_ids, request.sampling, request.guide, tuple(request.prefix_blocks),
                request.vision, request.prompt_cache_keys, request.speculative,
            ))
            if request.is_prefilling:
                budget = self._add_chunk(request, budget, chunks)
        return chunks

    def _add_chunk(self, request: Request, budget: int | None, chunks: list[PrefillChunk]) -> int | None:
        start = request.num_computed_tokens
        remaining = self.kv.prefill_target(request) - start
        limits = [n for n in (budget, self.config.prefill_chunk_limit) if n is not None]
        end = start + min([remaining, *limits])
        request.num_computed_tokens = end
        completes = not request.is_prefilling
        if completes:
            request.num_decode_steps = 1  # the completing chunk samples the first token
        chunks.append(PrefillChunk(
            request.request_id, start, tuple(request.prompt_token_ids[start:end]), completes,
            cache_prompt=completes and self.kv.should_cache_prompt(request),
            snapshot=self.kv.should_snapshot(request, end),
        ))
        return None if budget is None else budget - (end - start)

    # ---- introspection ---------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)
