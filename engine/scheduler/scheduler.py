"""Token-budget scheduler: plain Python, no MLX.

Each step every decoding request computes one token, and prefilling requests
share a per-step prefill token budget, each taking at most one chunk (chunked
prefill), so a long prompt is spread over many steps and never freezes the
streams already running, while a burst of short prompts starts in few steps.

With a KV budget (kv/budget.py) every step's KV is planned before it runs: when the running requests' next step
would not fit, the newest are preempted (their KV freed, a decode row's kept by the prefix cache) and re-queued
at the front, to resume by recomputing prompt + generated tokens; prompts are admitted and chunked within it.

Priority classes (request.Priority): the waiting queue holds interactive requests ahead of batch ones, prefills
run in that order, and an interactive request waiting for a decode slot takes the newest batch request's (which
is preempted as for KV); a KV preemption takes batch requests first.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from engine.config import EngineConfig
from engine.errors import QueueFullError, QueueTimeoutError
from engine.kv.budget import KVBudget, KVPlan
from engine.kv.cache_manager import KVCacheManager
from engine.request import Priority, Request, RequestStatus
from engine.scheduler.kv_fit import (
    admission_headroom, chunk_that_fits, count_headroom, draft_allowance, growth_lengths, may_admit,
    newest_of_lowest_class, step_plan,
)
from engine.sampling.held_guides import HeldGuides
from engine.scheduler_output import DecodeRow, ExpiredRequest, NewRequest, PrefillChunk, SchedulerOutput


@dataclass
class RunningSplit:
    """The running requests at the start of a step, in admission order: those prefilling, and those that decode this
    step (at most max_decode_seqs)."""

    prefilling: list[Request]
    decodable: list[Request]


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        clock: Callable[[], float] = time.monotonic,
        kv: KVCacheManager | None = None,
        kv_budget: KVBudget | None = None,
        guides: HeldGuides | None = None,
    ) -> None:
        self.config = config
        self.kv = kv or KVCacheManager()
        # The requests' compiled guides, held from add_request until they finish (the runner resolves them).
        self.guides = guides if guides is not None else HeldGuides()
        # None: admission by count only.
        self.kv_budget = kv_budget
        self.num_preemptions = 0
        # The KV the last scheduled step holds when it ends, as planned, and the most any step planned.
        self.kv_planned_bytes = 0
        self.kv_peak_planned_bytes = 0
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
        self._enqueue(request)
        if request.guide is not None:
            self.guides.hold(request.sampling.guided, request.guide)

    def _enqueue(self, request: Request, front: bool = False) -> None:
        """Into the waiting queue behind every request of a higher class; `front`: ahead of its own class too (a
        preempted request resumes first)."""
        waiting = self.waiting
        if not front and (not waiting or waiting[-1].priority <= request.priority):
            waiting.append(request)
            return
        place = next((i for i, queued in enumerate(waiting)
                      if queued.priority > request.priority or (front and queued.priority == request.priority)),
                     len(waiting))
        waiting.insert(place, request)

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
            if request.num_preemptions:  # the runner kept its sampling state for the resumption
                self._freed_request_ids.append(request.request_id)
        self.kv.release(request)
        if request.guide is not None:
            self.guides.release(request.sampling.guided)
        request.status = status

    # ---- scheduling ------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self.kv.begin_step()
        output = SchedulerOutput(freed_request_ids=self._freed_request_ids)
        self._freed_request_ids = []
        output.expired = self._expire_waiting()
        split = self._split_running()
        preempted = self._preempt_to_fit(split) + self._preempt_for_interactive()
        if preempted:
            split = self._split_running()
        decoding, output.decode_rows = self._schedule_decodes(split.decodable)
        output.rows_to_cache = self._leaving_rows_to_cache(decoding)  # a preempted row's KV too, at its length
        for request in preempted:
            request.num_computed_tokens = 0
        output.preempted_request_ids = [r.request_id for r in preempted]
        spec = self.config.speculative
        plan = step_plan(self.kv_budget, decoding, split.prefilling, spec) if self.kv_budget is not None else None
        output.prefill_chunks = self._schedule_prefills(output.new_requests, plan, split.prefilling)
        if plan is not None:
            self.kv_planned_bytes = plan.bytes
            self.kv_peak_planned_bytes = max(self.kv_peak_planned_bytes, self.kv_planned_bytes)
        return output

    def _split_running(self) -> RunningSplit:
        """One pass over the running requests (each schedule used to take one per phase: 0.6 ms a step at 128 rows,
        against ~9 ms for the H200's whole step)."""
        prefilling: list[Request] = []
        decodable: list[Request] = []
        cap = self.config.max_decode_seqs
        for request in self.running:
            if request.is_prefilling:
                prefilling.append(request)
            elif request.wants_more_decode_steps and len(decodable) < cap:
                decodable.append(request)
        return RunningSplit(prefilling, decodable)

    # ---- the KV budget -----------------------------------------------------
    def _preempt_to_fit(self, split: RunningSplit) -> list[Request]:
        """Preempt the newest requests holding KV until the next step fits (one alone always fits: checked at
        submit)."""
        if self.kv_budget is None:
            return []
        rows, prefills = growth_lengths(split.decodable, split.prefilling, self.config.speculative)
        if self.kv_budget.bytes_of(rows, prefills) <= self.kv_budget.budget_bytes:
            return []  # the common case, told without building the plan
        plan = KVPlan(self.kv_budget, dict(zip((r.request_id for r in split.decodable), rows)),
                      dict(zip((r.request_id for r in split.prefilling), prefills)))
        preempted: list[Request] = []
        while not plan.fits():
            holders = [r for r in self.running if plan.rows.get(r.request_id) or plan.prefills.get(r.request_id)]
            if len(holders) <= 1:
                break
            victim = newest_of_lowest_class(holders)
            self._preempt(victim)
            plan.drop(victim.request_id)
            preempted.append(victim)
        return preempted

    def _preempt_for_interactive(self) -> list[Request]:
        """The newest batch requests, one per interactive request that waits for a decode slot none has free."""
        waiting = sum(1 for r in self.waiting if r.priority == Priority.INTERACTIVE)
        needed = waiting - max(0, self.config.max_decode_seqs - len(self.running))
        preempted: list[Request] = []
        while needed > 0:
            batch = [r for r in self.running if r.priority > Priority.INTERACTIVE]
            if not batch:
                break
            self._preempt(batch[-1])
            preempted.append(batch[-1])
            needed -= 1
        return preempted

    def _preempt(self, request: Request) -> None:
        """Back to the front of the queue (of its class); its prefix-cache blocks stay cached, unlocked."""
        self.running.remove(request)
        self.kv.release(request)
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(request, front=True)

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
        # A preempted request was admitted once: it waits for KV, not for a slot.
        expired = [r for r in self.waiting if now - r.arrival_time > timeout and r.status == RequestStatus.WAITING]
        for request in expired:
            request.error = QueueTimeoutError(
                f"Request waited {now - request.arrival_time:.1f}s in the queue (queue_timeout={timeout}s)"
            )
            self.finish_request(request, RequestStatus.FINISHED_ERROR)
        return [ExpiredRequest(r.request_id, r.error) for r in expired]

    def _schedule_decodes(self, decodable: list[Request]) -> tuple[dict[str, Request], list[DecodeRow]]:
        decodes: dict[str, Request] = {}
        rows: list[DecodeRow] = []
        drafting = self.config.speculative is not None
        for request in decodable:
            request.num_decode_steps += 1
            request.num_computed_tokens += 1
            decodes[request.request_id] = request
            drafts = draft_allowance(self.config.speculative, request) if drafting else 0
            rows.append(DecodeRow(request.request_id, request.num_decode_steps - 1, drafts))
        return decodes, rows

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

    def _schedule_prefills(
        self, new_requests: list[NewRequest], plan: KVPlan | None, prefilling: list[Request]
    ) -> list[PrefillChunk]:
        budget, limit = self.config.prefill_token_budget, self._prefill_seqs_limit()
        chunks: list[PrefillChunk] = []
        firsts: set[tuple[int, ...] | None] = set()  # the first prefix blocks of the prompts this step prefills
        for request in sorted(prefilling, key=lambda r: r.priority):  # stable: admission order within a class
            if len(chunks) == limit or budget == 0:
                return chunks
            scheduled = len(chunks)
            budget = self._add_chunk(request, budget, chunks, plan)
            if len(chunks) == scheduled:
                return chunks  # out of KV: no newer request may take it first
            firsts.add(self.kv.first_block(request))
        headroom = admission_headroom(self.kv_budget, self.running) if plan is not None and self.waiting else None
        while self.waiting and len(self.running) < self.config.max_decode_seqs:
            if len(chunks) == limit or budget == 0:
                break
            request = self.waiting[0]
            if request.num_output_tokens < request.num_decode_steps:
                break  # preempted with its last token in flight: it resumes once that token is read
            if not may_admit(request, headroom) or not self._may_join_burst(request, len(chunks), firsts):
                break
            self.waiting.remove(request)
            self._admit(request, new_requests)
            if request.is_prefilling:
                budget = self._add_chunk(request, budget, chunks, plan)
                firsts.add(self.kv.first_block(request))
            if headroom is not None:
                count_headroom(headroom, request)
        return chunks

    def _may_join_burst(self, request: Request, num_chunks: int, firsts: set[tuple[int, ...] | None]) -> bool:
        """Past max_prefill_seqs (a burst), only prompts unlike this step's: one sharing a first prefix block with
        them waits a step to hit their KV in the prefix cache, as it would beside decode rows."""
        if num_chunks < self.config.max_prefill_seqs:
            return True
        first = self.kv.first_block(request)
        return first is None or first not in firsts

    def _prefill_seqs_limit(self) -> int:
        """Prompts one step prefills: max_prefill_seqs beside decode rows (whose step time it bounds); with none
        decoding and a token budget bounding the step, a burst up to max_decode_seqs (its forwards stay
        max_prefill_seqs rows each). The burst's rows then decode at one length: rows joined in waves differ in
        length, and their masked attention took 17.4-17.8 against 14.6 ms a step at 128 rows on an H200 (issue 57)."""
        config = self.config
        if self._decoding or config.prefill_token_budget is None:
            return config.max_prefill_seqs
        return max(config.max_prefill_seqs, config.max_decode_seqs)

    def _admit(self, request: Request, new_requests: list[NewRequest]) -> None:
        """Into the running set; a preempted request's prefill recomputes what it generated so far."""
        resumed = request.num_preemptions > 0
        if resumed:
            request.num_recomputed_outputs = request.num_output_tokens
        request.status = RequestStatus.RUNNING
        request.unpaid_vision_tokens = request.vision_cost_tokens  # its tower runs again at its next first chunk
        self.running.append(request)
        self.kv.reuse_cached_prefix(request)
        keys = request.prefill_cache_keys() if request.prompt_cache_keys is not None else None
        new_requests.append(NewRequest(
            request.request_id, request.prefill_token_ids(), request.sampling,
            tuple(block.block_hash for block in request.prefix_blocks), request.vision, keys, request.speculative,
            resumed=resumed, num_generated=request.num_recomputed_outputs, adapter_slot=request.adapter_slot,
            held_image_features=request.held_image_features, cached_tail_tokens=request.prefix_tail_tokens,
        ))

    def _add_chunk(
        self, request: Request, budget: int | None, chunks: list[PrefillChunk], plan: KVPlan | None = None
    ) -> int | None:
        start = request.num_computed_tokens
        remaining = self.kv.prefill_target(request) - start
        limits = [n for n in (budget, self.config.prefill_chunk_limit) if n is not None]
        size = min([remaining, *limits])
        if plan is not None:
            size = chunk_that_fits(request, start, size, plan, self.config.speculative)
            if size == 0:
                return budget
            plan.prefills[request.request_id] = start + size
        end = start + size
        request.num_computed_tokens = end
        completes = not request.is_prefilling
        if completes:
            # The completing chunk samples the first token (after a preemption: the next one).
            request.num_decode_steps = request.num_recomputed_outputs + 1
        chunks.append(PrefillChunk(
            request.request_id, start, tuple(request.prefill_token_ids()[start:end]), completes,
            cache_prompt=completes and self.kv.should_cache_prompt(request),
            snapshot=self.kv.should_snapshot(request, end),
        ))
        tower, request.unpaid_vision_tokens = request.unpaid_vision_tokens, 0
        return None if budget is None else max(0, budget - (end - start) - tower)

    # ---- introspection ---------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_preempted(self) -> int:
        """Preempted requests waiting to resume."""
        return sum(1 for r in self.waiting if r.status == RequestStatus.PREEMPTED)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

