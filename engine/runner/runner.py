"""The only place that calls the model: batched prefill chunks and pipelined decode.

A chunk that completes its prompt samples the request's first token at once (read back
in the same step). Decode is pipelined like mlx-lm's own loop: step N's forward is queued
on the device before step N-1's tokens are read back, so Python bookkeeping overlaps
device work. Rows whose penalties need the previous token force a read first.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Iterable

import mlx.core as mx

from engine.config import EngineConfig
from engine.kv.batch_cache import (
    LayerCaches,
    cache_arrays,
    cache_nbytes,
    new_request_cache,
)
from engine.kv.block_store import KVBlockStore, buffer_cache_limit_bytes, default_budget_bytes, prefix_cache_mode
from engine.kv.plain_batch import RowBlock
from engine.kv.prefix_cache import PrefixCache
from engine.request import Request
from engine.runner.decode_batch import DecodeBatch, PendingStep, new_row_sampling
from engine.runner.head_split import head_split
from engine.runner.loader import LoadedModel
from engine.runner.outputs import RunnerOutput, SampledToken
from engine.runner.prefill import PrefillResult, run_prefill
from engine.runner.prefill_shapes import warmup_shapes
from engine.runner.warmup import warm_prefill_shapes
from engine.sampling.sampler import BatchSampler, RowSampling
from engine.scheduler.output import PrefillChunk, SchedulerOutput


@dataclass
class PrefilledPrompts:
    """A step's prefill chunks and result, kept until their completed prompts are cached."""

    chunks: list[PrefillChunk]
    result: PrefillResult


class ModelRunner:
    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        self.model = loaded.model
        self.config = config
        self.stream = mx.new_stream(mx.default_device())
        self._rng = random.Random(config.seed) if config.seed is not None else random.SystemRandom()
        self.batch = DecodeBatch(vocab_size=loaded.vocab_size)
        self._prefill_caches: dict[str, LayerCaches] = {}
        # Where a completed prompt's KV sits in its padded forward's batch (joins decode with its neighbours).
        self._joiner_blocks: dict[str, RowBlock] = {}
        # Completed prompts not yet copied into the prefix cache (cache_prefilled_prompts).
        self._uncached: list[PrefilledPrompts] = []
        # Sampling rows of requests past their first token, and each joiner's first decode input.
        self._rows: dict[str, RowSampling] = {}
        self._next_inputs: dict[str, int] = {}
        self._batch_requests: dict[str, Request] = {}
        self._pending: PendingStep | None = None
        # Freed buffers of sizes that will not recur (prefill shapes, batch resizes) would
        # otherwise pile up in MLX's buffer cache until device memory runs out.
        self._previous_cache_limit = mx.set_cache_limit(buffer_cache_limit_bytes())
        self.prefix_cache: PrefixCache | None = None
        mode = prefix_cache_mode(self.model) if config.enable_prefix_cache else None
        if mode is not None:
            budget = config.prefix_cache_bytes if config.prefix_cache_bytes is not None else default_budget_bytes()
            self.prefix_cache = PrefixCache(config.prefix_block_size, budget, snapshot_only=mode == "snapshots")
        self._blocks = KVBlockStore(self.model, self.prefix_cache) if self.prefix_cache else None
        self.pad_prefill_shapes = _resolve_pad_shapes(config.pad_prefill_shapes, self.model)
        # Prefill logits at the completing positions only, where the model splits exactly (else None).
        self.head_split = head_split(self.model)

    # ---- one engine step -------------------------------------------------
    def execute(self, scheduled: SchedulerOutput, before_device_work: Callable[[], None] | None = None) -> RunnerOutput:
        """Run one step. before_device_work, if given, is called once, when the decode forward's graph is
        built and the device (and the GIL-free launch of its work) comes next."""
        with mx.stream(self.stream):
            for request_id in scheduled.freed_request_ids:
                self._forget(request_id)
            needs_history = any(r.sampling.needs_token_history for r in scheduled.decode_requests)
            sampled = []
            # The prompts go to the device first, so their first tokens do not wait for the decode forward,
            # nor for the copies of earlier prompts into the prefix cache (CPU work while the device runs them).
            earlier, self._uncached = self._uncached, []
            first = self._dispatch_prefill(scheduled.prefill_chunks)
            self._insert_prefilled(earlier)
            logits = self._dispatch_forward(scheduled.decode_requests)
            if before_device_work is not None:
                before_device_work()
            if needs_history:
                # Penalties and guides need the previous step's tokens before sampling, not before
                # the forward: the device runs this step's forward while they are read back.
                if logits is not None:
                    mx.async_eval(logits)
                sampled = self._read_pending()
            dispatched = self._dispatch_sampling(logits, scheduled.decode_requests)
            if self._blocks is not None:
                self._blocks.flush()
            first_tokens = self._collect_first_tokens(first)
            if not needs_history:
                sampled = self._read_pending()
            self._pending = dispatched
        return RunnerOutput(sampled + first_tokens, num_first_tokens=len(first_tokens))

    def cache_prefilled_prompts(self, waiting: Iterable[Request]) -> None:
        """Copy the last step's completed prompts into the prefix cache before the next step is scheduled,
        if a waiting request may hit them (it shares their first block). Otherwise execute() copies them
        once the step's own prompts are on the device: the copies cost CPU time (~15 ms for 32 prompts of
        517 tokens on an H100) that new prompts' first tokens would wait for, in the step after a burst."""
        if self._uncached and self._may_hit_uncached(waiting):
            with mx.stream(self.stream):
                self._insert_prefilled(self._uncached)
            self._uncached = []

    def _may_hit_uncached(self, waiting: Iterable[Request]) -> bool:
        size = self.prefix_cache.block_size
        firsts = {
            tuple(chunk.request.prompt_token_ids[:size])
            for prompts in self._uncached for chunk in prompts.chunks if len(chunk.request.prompt_token_ids) >= size
        }
        return any(tuple(r.prompt_token_ids[:size]) in firsts for r in waiting if not r.num_computed_tokens)

    def _insert_prefilled(self, prefilled: list[PrefilledPrompts]) -> None:
        for prompts in prefilled:
            self._insert_prompts(prompts.chunks, prompts.result)
        if prefilled:
            self._blocks.flush()

    def _forget(self, request_id: str) -> None:
        self._prefill_caches.pop(request_id, None)
        self._joiner_blocks.pop(request_id, None)
        self._rows.pop(request_id, None)
        self._next_inputs.pop(request_id, None)

    def _read_pending(self) -> list[SampledToken]:
        if self._pending is None:
            return []
        sampled = self._pending.read()
        self.batch.record_tokens(sampled, self._rows)
        return sampled

    def _dispatch_forward(self, requests: list[Request]) -> mx.array | None:
        joiner_caches = {r.request_id: self._joiner_cache(r) for r in requests if r.request_id not in self.batch.rows}
        blocks = {rid: self._joiner_blocks.pop(rid) for rid in joiner_caches if rid in self._joiner_blocks}
        self._cache_leaving_rows({r.request_id for r in requests})
        previous_ids = list(self.batch.request_ids)
        keep_rows = self.batch.update_membership(requests, joiner_caches, self._rows, blocks)
        if not self.batch.request_ids:
            return None
        inputs = self._decode_inputs(previous_ids, keep_rows)
        return self.model(inputs[:, None], cache=self.batch.caches)[:, -1, :]

    def _dispatch_sampling(self, logits: mx.array | None, requests: list[Request]) -> PendingStep | None:
        if logits is None:
            return None
        by_id = {r.request_id: r for r in requests}
        steps = [by_id[rid].num_decode_steps - 1 for rid in self.batch.request_ids]
        sampled = self.batch.sampler.sample(logits, steps)
        mx.async_eval(sampled.arrays())
        return PendingStep(list(self.batch.request_ids), sampled, self.batch.top_logprob_counts())

    def _decode_inputs(self, previous_ids: list[str], keep_rows: list[int]) -> mx.array:
        """Kept rows feed their pending sampled token (still lazy); joiners their first token."""
        parts = []
        if keep_rows:
            assert self._pending is not None and self._pending.request_ids == previous_ids
            previous_tokens = self._pending.sampled.token_ids
            if len(keep_rows) == len(previous_ids):
                parts.append(previous_tokens)
            else:
                parts.append(previous_tokens[mx.array(keep_rows)])
        joiner_ids = self.batch.request_ids[len(keep_rows) :]
        if joiner_ids:
            parts.append(mx.array([self._next_inputs.pop(rid) for rid in joiner_ids], mx.uint32))
        return parts[0] if len(parts) == 1 else mx.concatenate(parts)

    def _joiner_cache(self, request: Request) -> LayerCaches:
        """The finished prefill cache of a request joining decode."""
        self._batch_requests[request.request_id] = request
        return self._prefill_caches.pop(request.request_id)

    def _cache_leaving_rows(self, staying: set[str]) -> None:
        """Feed the KV of requests leaving the batch (prompt and generated tokens) to the prefix cache."""
        for row, request_id in enumerate(self.batch.request_ids):
            if request_id in staying:
                continue
            request = self._batch_requests.pop(request_id)
            if self._blocks is None or self.prefix_cache.snapshot_only:
                continue
            token_ids = request.all_token_ids()[: request.num_computed_tokens]  # what the KV holds
            self._blocks.insert(token_ids, lambda row=row: self.batch.row_cache(row))

    def _request_cache(self, request: Request) -> LayerCaches:
        """A new per-request cache holding the KV of the request's cached prefix blocks, if any."""
        if self._blocks is None:
            return new_request_cache(self.model)
        return self._blocks.request_cache(request.prefix_blocks)

    # ---- prefill ---------------------------------------------------------
    def _dispatch_prefill(self, chunks: list[PrefillChunk]) -> PendingStep | None:
        """Queue this step's prompt chunks on the device; the completing ones' first tokens are sampled
        in the same queue (read back by _collect_first_tokens)."""
        if not chunks:
            return None
        caches = [self._prefill_cache(chunk.request) for chunk in chunks]
        rows_limit = self.config.max_prefill_seqs if self.pad_prefill_shapes else None
        result = run_prefill(self.model, chunks, caches, rows_limit, self.batch.vocab_size, self.head_split)
        for chunk, cache in zip(chunks, result.caches):
            self._prefill_caches[chunk.request.request_id] = cache
            self._maybe_snapshot(chunk, cache)
        self._note_joiner_blocks(chunks, result)
        if self._blocks is not None and not self.prefix_cache.snapshot_only:
            self._uncached.append(PrefilledPrompts(chunks, result))
        if not result.completing:
            return None
        requests = [chunk.request for chunk in result.completing]
        rows = [self._row_sampling(request) for request in requests]
        sampled = BatchSampler(rows, self.batch.vocab_size).sample(result.last_logits, [0] * len(rows))
        mx.async_eval([*sampled.arrays(), *_prefilled_arrays(result)])
        return PendingStep([r.request_id for r in requests], sampled, [r.params.top_logprobs for r in rows])

    def _collect_first_tokens(self, step: PendingStep | None) -> list[SampledToken]:
        if step is None:
            return []
        tokens = step.read()
        for token in tokens:
            self._next_inputs[token.request_id] = token.token_id
        self.batch.record_tokens(tokens, self._rows)
        return tokens

    def _insert_prompts(self, chunks: list[PrefillChunk], result: PrefillResult) -> None:
        """Cache the prompts these chunks completed: padded forwards' rows together, others one by one."""
        inserted = self._insert_shared_prompts(chunks, result)
        for i, (chunk, cache) in enumerate(zip(chunks, result.caches)):
            if i not in inserted and chunk.completes_prefill and self._has_uncached_prompt_blocks(chunk.request):
                self._blocks.insert(chunk.request.prompt_token_ids, cache)

    def _note_joiner_blocks(self, chunks: list[PrefillChunk], result: PrefillResult) -> None:
        for i, block in result.row_blocks().items():
            if chunks[i].completes_prefill:
                self._joiner_blocks[chunks[i].request.request_id] = block

    def _insert_shared_prompts(self, chunks: list[PrefillChunk], result: PrefillResult) -> set[int]:
        """Cache completed prompts of padded forwards from their batched cache, a forward at a time."""
        inserted: set[int] = set()
        for shared in result.shared:
            wanted = [
                (position, i) for position, i in enumerate(shared.rows)
                if chunks[i].completes_prefill and self._has_uncached_prompt_blocks(chunks[i].request)
            ]
            prompts = [chunks[i].request.prompt_token_ids for _, i in wanted]
            if len(wanted) > 1 and self._blocks.insert_rows(prompts, shared.caches, [p for p, _ in wanted]):
                inserted.update(i for _, i in wanted)
        return inserted

    def _has_uncached_prompt_blocks(self, request: Request) -> bool:
        """Whether the prompt holds full blocks beyond those it was served from (a full hit has none)."""
        if self._blocks is None or self.prefix_cache.snapshot_only:
            return False
        return len(request.prefix_blocks) < len(request.prompt_token_ids) // self.prefix_cache.block_size

    def _row_sampling(self, request: Request) -> RowSampling:
        """A request's sampling row, made once: its seed and token history follow it into decode."""
        row = self._rows.get(request.request_id)
        if row is None:
            row = self._rows[request.request_id] = new_row_sampling(request, self._rng)
        return row

    def _maybe_snapshot(self, chunk: PrefillChunk, cache: LayerCaches) -> None:
        """In snapshot mode, a chunk ending on a block boundary leaves a whole-cache snapshot."""
        if self._blocks is None or not self.prefix_cache.snapshot_only:
            return
        end = chunk.start + chunk.num_tokens
        if end % self.prefix_cache.block_size == 0 and end > len(chunk.request.prefix_blocks) * self.prefix_cache.block_size:
            self._blocks.insert_snapshot(chunk.request.prompt_token_ids[:end], cache)

    def _prefill_cache(self, request: Request) -> LayerCaches:
        if request.request_id not in self._prefill_caches:
            self._prefill_caches[request.request_id] = self._request_cache(request)
        return self._prefill_caches[request.request_id]

    # ---- housekeeping ----------------------------------------------------
    def release_buffers(self) -> None:
        """Hand MLX's cache of freed buffers back to the device; under load its cap (set at start) bounds it.

        Only with nothing in flight: freeing holds the GIL and can wait for the device (run every 256 steps,
        py-spy saw it hold the GIL ~36 ms per 8 s of bursts on the H100, while the replica's event loop waited).
        """
        if not self.holds_state():
            mx.clear_cache()

    def kv_cache_bytes(self) -> int:
        total = cache_nbytes(self.batch.caches) if self.batch.caches else 0
        return total + sum(cache_nbytes(c) for c in self._prefill_caches.values())

    def holds_state(self) -> bool:
        """True while a dispatched step is unread or any KV is still held (freed by the next step)."""
        return self._pending is not None or len(self.batch) > 0 or bool(self._prefill_caches) or bool(self._uncached)

    def warmup(self) -> None:
        """Build kernels before the first request: one tiny forward, and every padded prefill shape."""
        with mx.stream(self.stream):
            cache = new_request_cache(self.model)
            logits = self.model(mx.array([[0, 1]], mx.uint32), cache=cache)
            mx.eval(logits)
            if self.pad_prefill_shapes:
                vocab = self.batch.vocab_size
                shapes = warmup_shapes(
                    self.config.max_prefill_seqs, self.config.prefill_token_budget, self.config.prefill_chunk_limit,
                    head_split=self.head_split is not None,
                )
                new_cache = lambda: new_request_cache(self.model)  # noqa: E731
                warm_prefill_shapes(
                    self.model, shapes, new_cache, self.config.prefill_warmup_seconds, vocab, self.config.max_prefill_seqs,
                    self.head_split,
                )
            mx.clear_cache()

    def close(self) -> None:
        self._pending = None
        self._prefill_caches.clear()
        self._joiner_blocks.clear()
        self._uncached.clear()
        self._batch_requests.clear()
        self._rows.clear()
        self._next_inputs.clear()
        if self.prefix_cache is not None:
            self.prefix_cache.evict_all_unlocked()
        self.batch.caches = []
        mx.clear_cache()
        mx.set_cache_limit(self._previous_cache_limit)


def _prefilled_arrays(result: PrefillResult) -> list:
    """The step's KV: padded forwards' batches whole (their rows' caches are views of them: one
    array per layer, not one per row), other caches as they are."""
    in_shared = {i for shared in result.shared for i in shared.rows}
    arrays = [cache_arrays(shared.caches) for shared in result.shared]
    return arrays + [cache_arrays(c) for i, c in enumerate(result.caches) if i not in in_shared]


def _resolve_pad_shapes(setting: bool | None, model) -> bool:
    """Padding needs caches that take right padding and cut it off exactly: plain KV caches."""
    if prefix_cache_mode(model) != "blocks":
        return False
    return setting if setting is not None else mx.default_device().type == mx.gpu
