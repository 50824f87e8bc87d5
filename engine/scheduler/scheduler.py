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
from engine.kv.prefix_cache import PrefixCache
from engine.request import Request, RequestStatus
from engine.scheduler.output import PrefillChunk, SchedulerOutput


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        clock: Callable[[], float] = time.monotonic,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        self.config = config
        self.prefix_cache = prefix_cache
        self._clock = clock
        self.waiting: deque[Request] = deque()
        # Admitted requests (prefilling or decoding), in admission order.
        self.running: list[Request] = []
        self._freed_request_ids: list[str] = []

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
        if self.prefix_cache is not None and request.prefix_blocks:
            self.prefix_cache.unlock(request.prefix_blocks)
            request.prefix_blocks = []
        request.status = status

    # ---- scheduling ------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput(freed_request_ids=self._freed_request_ids)
        self._freed_request_ids = []
        output.expired_requests = self._expire_waiting()
        output.decode_requests = self._schedule_decodes()
        output.prefill_chunks = self._schedule_prefills()
        return output

    def _expire_waiting(self) -> list[Request]:
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
        return expired

    def _schedule_decodes(self) -> list[Request]:
        decodes = []
        for request in self.running:
            if request.is_prefilling or not request.wants_more_decode_steps:
                continue
            if len(decodes) == self.config.max_decode_seqs:
                break
            request.num_decode_steps += 1
            request.num_computed_tokens += 1
            decodes.append(request)
        return decodes

    def _schedule_prefills(self) -> list[PrefillChunk]:
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
            self._reuse_cached_prefix(request)
            if request.is_prefilling:
                budget = self._add_chunk(request, budget, chunks)
        return chunks

    def _reuse_cached_prefix(self, request: Request) -> None:
        """Skip the prompt's longest cached block prefix (never the last prompt token: its logits
        give the first output token)."""
        if self.prefix_cache is None or request.num_computed_tokens:
            return
        blocks = self.prefix_cache.match(request.prompt_token_ids, max_tokens=request.num_prefill_tokens - 1)
        self.prefix_cache.lock(blocks)
        request.prefix_blocks = blocks
        request.num_cached_tokens = request.num_computed_tokens = len(blocks) * self.prefix_cache.block_size

    def _add_chunk(self, request: Request, budget: int | None, chunks: list[PrefillChunk]) -> int | None:
        remaining = self._prefill_target(request) - request.num_computed_tokens
        limits = [n for n in (budget, self.config.prefill_chunk_limit) if n is not None]
        num_tokens = min([remaining, *limits])
        chunks.append(PrefillChunk(request, request.num_computed_tokens, num_tokens))
        request.num_computed_tokens += num_tokens
        if not request.is_prefilling:
            request.num_decode_steps = 1  # the completing chunk samples the first token
        return None if budget is None else budget - num_tokens

    def _prefill_target(self, request: Request) -> int:
        """Where this request's next chunk may end: its prefill end, or first the last block
        boundary before it when the prefix cache keeps whole-cache snapshots there."""
        end = request.num_prefill_tokens
        if self.prefix_cache is None or not self.prefix_cache.snapshot_only:
            return end
        boundary = end - end % self.prefix_cache.block_size
        return boundary if request.num_computed_tokens < boundary else end

    # ---- introspection ---------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)
