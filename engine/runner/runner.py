"""The only place that calls the model: batched prefill chunks and pipelined decode.

A chunk that completes its prompt samples the request's first token at once (read back
in the same step). Decode is pipelined like mlx-lm's own loop: step N's forward is queued
on the device before step N-1's tokens are read back, so Python bookkeeping overlaps
device work. Rows whose penalties need the previous token force a read first. A step where
rows verify drafts (speculative decoding, verify_step.py) reads the previous step first and
its own tokens before it ends. Given on_tokens, a plain step hands the previous step's tokens over on a worker
thread during its own launch (overlapped_launch.py).
"""

from __future__ import annotations

import random
import time
from functools import partial
from typing import Any, Callable

import mlx.core as mx

from engine.adapters.served import ServedAdapters
from engine.config import EngineConfig
from engine.device_memory import EngineMemoryLimit, on_gpu
from engine.kv.batch_cache import LayerCaches, cache_nbytes, new_request_cache
from engine.kv.block_store import KVBlockStore, buffer_cache_limit_bytes
from engine.kv.cache_manager import PrefixCache
from engine.kv.plain_batch import RowBlock
from engine.models.head_split import HeadSplit, head_split
from engine.models.loader import LoadedModel
from engine.runner.adapter_rows import AdapterRows
from engine.runner.decode_batch import DecodeBatch, Membership, Upcoming, is_dead_row, new_row_sampling, step_inputs
from engine.runner.memory import vision_features_budget
from engine.runner.overlapped_launch import OverlappedLaunch
from engine.runner.prefill import PrefillResult, resolve_pad_shapes, run_prefill
from engine.runner.prompt_copies import PrefilledPrompts, PromptCopies
from engine.runner.verify_step import SpeculativeDecoder, execute_verifying
from engine.runner.vision_prefill import VisionPrompts
from engine.runner.warmup import warm_up_model
from engine.runner_output import RunnerOutput, SampledToken
from engine.sampling.held_guides import HeldGuides
from engine.sampling.pending_step import PendingStep
from engine.sampling.sampler import BatchSampler, RowSampling
from engine.scheduler_output import DecodeRow, NewRequest, PrefillChunk, SchedulerOutput
from engine.spec_decode.speculator import SpeculationStats
from engine.vision.feature_cache import FeatureCache
from engine.vision.model import VisionLanguageModel
from engine.vision.text_twin import twin_prefill


# A step reads the previous step's tokens before its own launch (a worker takes them in during it) while such reads
# find them ready (0.18 ms a step at 128 rows on an H200); past this the device bounds the step: launch, then read.
OVERLAP_MAX_READ_WAIT_S = 0.5e-3


class ModelRunner:
    def __init__(
        self, loaded: LoadedModel, config: EngineConfig, guides: HeldGuides, prefix_cache: PrefixCache | None = None,
        speculation: SpeculativeDecoder | None = None, adapters: ServedAdapters | None = None,
    ) -> None:
        self.model = loaded.model
        self.config = config
        self.kv_quantization = config.kv_quantization  # quantized KV (config kv_bits), checked by EngineCore
        self.stream = mx.new_stream(mx.default_device())
        self._rng = random.Random(config.seed) if config.seed is not None else random.SystemRandom()
        self.batch = DecodeBatch(vocab_size=loaded.vocab_size)
        # What the runner keeps of each scheduled request (from its NewRequest) until it is freed.
        self._requests: dict[str, NewRequest] = {}
        self._adapter_rows = AdapterRows(adapters, self._requests)  # per-request LoRA: each forward's rows' slots
        # Structured-output guides by a NewRequest's guide_key, held by the scheduler while their requests live.
        self._guides = guides
        self._prefill_caches: dict[str, LayerCaches] = {}
        # Where a completed prompt's KV sits in its padded forward's batch (joins decode with its neighbours).
        self._joiner_blocks: dict[str, RowBlock] = {}
        # Sampling rows of requests past their first token, and each joiner's first decode input.
        self._rows: dict[str, RowSampling] = {}
        # Those of them whose penalties or guides read their tokens: with none, a step skips the per-row checks.
        self._history_rows: set[str] = set()
        self._next_inputs: dict[str, int] = {}
        self._pending: PendingStep | None = None
        self._launch = OverlappedLaunch()
        self.overlap_max_read_wait_s, self._last_read_wait_s = OVERLAP_MAX_READ_WAIT_S, 0.0
        self.read_wait_seconds = 0.0  # summed over steps: time blocked reading sampled tokens back from the device
        # Freed buffers of sizes that will not recur (prefill shapes, batch resizes) would pile up in MLX's buffer cache.
        self._previous_cache_limit = mx.set_cache_limit(buffer_cache_limit_bytes())
        # Past it MLX waits for work in flight before launching more (device_memory.py).
        self._memory_limit = EngineMemoryLimit()
        self.prefix_cache = prefix_cache
        self._blocks = KVBlockStore(self.model, prefix_cache, self.kv_quantization) if prefix_cache is not None else None
        self._copies = PromptCopies(self._blocks) if self._blocks is not None else None
        self.pad_prefill_shapes = resolve_pad_shapes(config.pad_prefill_shapes, self.model, self.kv_quantization is not None)
        # Vision-language models: prompts with images prefill from their embeddings (vision_prefill.py), kept
        # from a request's first chunk to its last; text after images sits at offset + delta (M-RoPE).
        self.vision = self.model if isinstance(self.model, VisionLanguageModel) else None
        # Prefill logits at the completing positions only, where the model splits exactly (else None).
        self.head_split = self.vision.head_split() if self.vision is not None else head_split(self.model)
        self._rope_deltas: dict[str, int] = {}
        self.text_twin = self.vision.text_twin if self.vision is not None else None
        self._twin_prefill = twin_prefill(self.text_twin)  # a VLM's text prefill, as its decode, through the twin
        self.features = FeatureCache(vision_features_budget(config)) if self.vision is not None else None
        self.vision_prompts = None if self.vision is None else VisionPrompts(
            self.vision, self.features, self.head_split, loaded.vocab_size, self._rope_deltas, self._twin_prefill,
            self.pad_prefill_shapes, config.max_prefill_seqs)
        # Speculative decoding (verify_step.py): models of plain KV caches only, not vision models.
        self.speculation = speculation if speculation is not None and self.vision is None else None
        self.batch.defer_leaves = self.speculation is None and on_gpu()

    # ---- one engine step -------------------------------------------------
    def execute(
        self, scheduled: SchedulerOutput, before_device_work: Callable[[], None] | None = None,
        on_tokens: Callable[[list[SampledToken]], None] | None = None,
    ) -> RunnerOutput:
        """Run one step. before_device_work: called once the decode forward's graph is built, before its launch.
        on_tokens: may get the previous step's tokens on a worker thread during this step's launch (then left out of
        the output, which holds the first tokens of completed prompts); a verifying step returns all."""
        self._memory_limit.refresh()
        with mx.stream(self.stream):
            for request_id in scheduled.freed_request_ids:
                self._forget(request_id)
            for request_id in scheduled.preempted_request_ids:
                self._drop_kv(request_id)
            for request in scheduled.new_requests:
                self._requests[request.request_id] = request
                if self.speculation is not None:
                    self.speculation.add(request)
            rows = scheduled.decode_rows
            lengths = self.speculation.plan(rows, self._rows) if self.speculation is not None and rows else None
            if lengths is not None:
                return execute_verifying(self, scheduled, lengths, before_device_work)
            started, pipelined = time.perf_counter(), self._pending is not None
            needs_history = bool(self._history_rows) and any(
                self._rows[row.request_id].params.needs_token_history for row in rows)
            first = self._dispatch_prompts(scheduled.prefill_chunks)
            # The rows joining next step: the prompts completing now.
            upcoming = [c.request_id for c in scheduled.prefill_chunks if c.completes_prefill]
            logits = self._dispatch_forward(rows, scheduled.rows_to_cache, upcoming)
            if before_device_work is not None:
                before_device_work()
            dispatched, sampled = self._launch_step(logits, rows, needs_history, on_tokens)
            if self._blocks is not None:
                self._blocks.flush()
            first_tokens = self._collect_first_tokens(first)
            if sampled is None:  # pipelined: the previous step's tokens, read once this step is on the device
                sampled = self._read_pending()
            self._pending = dispatched
            if self.speculation is not None and rows and not scheduled.prefill_chunks:
                self.speculation.observe_step(len(rows), 1, time.perf_counter() - started, pipelined)
        return RunnerOutput(sampled + first_tokens, num_first_tokens=len(first_tokens))

    def _launch_step(
        self, logits: mx.array | None, rows: list[DecodeRow], needs_history: bool,
        on_tokens: Callable[[list[SampledToken]], None] | None,
    ) -> tuple[PendingStep | None, list[SampledToken] | None]:
        """This step's sampling, launched; and the previous step's tokens where read already (None: not yet; [] where
        on_tokens took them, on the worker during the launch)."""
        handed = None
        if needs_history:
            # Penalties and guides need the previous step's tokens before sampling, not before
            # the forward: the device runs this step's forward while they are read back.
            if logits is not None:
                mx.async_eval(logits)
            handed = self._read_pending()
        dispatched = self._sampling_graph(logits, rows)
        arrays = dispatched.sampled.arrays() if dispatched is not None else []
        if on_tokens is None or (handed is None and self._last_read_wait_s > self.overlap_max_read_wait_s):
            self._launch.launch(arrays)  # the device bounds the step: a read first would leave it idle
            return dispatched, handed
        if handed is None:  # launching bounds the step: the device finished the previous one while this one was built
            handed = self._read_pending()
        self._launch.launch(arrays, partial(on_tokens, handed) if handed else None)
        return dispatched, []

    def run_towers_ahead(self, requests: list[Request]) -> list[Request]:
        """A VLM's features for requests not admitted yet (vision_prefill.py): those whose tower ran."""
        return self.vision_prompts.run_towers_ahead(requests) if self.vision_prompts is not None else []

    def cache_prefilled_prompts(self) -> None:
        """Copy the last step's completed prompts into the prefix cache now, before the next step is scheduled (a
        waiting request may hit them); else execute() copies them once that step's own prompts are on the device."""
        if self._copies:
            with mx.stream(self.stream):
                self._copies.copy(self._copies.take())

    def _dispatch_prompts(self, chunks: list[PrefillChunk]) -> PendingStep | None:
        """The prompts go to the device first, so their first tokens do not wait for the decode forward, nor for
        the copies of earlier prompts into the prefix cache (CPU work while the device runs them)."""
        earlier = self._copies.take() if self._copies is not None else []
        first = self._dispatch_prefill(chunks)
        if self._copies is not None:
            self._copies.copy(earlier)
        return first

    def _forget(self, request_id: str) -> None:
        self._drop_kv(request_id)
        self._requests.pop(request_id, None)
        self._rows.pop(request_id, None)
        self._history_rows.discard(request_id)

    def _drop_kv(self, request_id: str) -> None:
        """A preempted request's KV and progress (its decode row leaves the batch with this step's rows); its
        sampling row (seed, token history, guide state) stays for its resumption."""
        for held in (self._prefill_caches, self._joiner_blocks, self._next_inputs, self._rope_deltas):
            held.pop(request_id, None)
        for part in (self.vision_prompts, self.speculation):
            if part is not None:
                part.forget(request_id)

    def _read_pending(self) -> list[SampledToken]:
        """The pending step's tokens, read once (None pending after it)."""
        if self._pending is None:
            return []
        waited = self.read_wait_seconds
        sampled, self._pending = self._read(self._pending), None
        self._last_read_wait_s = self.read_wait_seconds - waited
        if self._history_rows:
            self.batch.record_tokens(sampled, self._rows)
        if self.speculation is not None:
            self.speculation.record(sampled)
        return sampled

    def _read(self, step: PendingStep) -> list[SampledToken]:
        started = time.perf_counter()
        tokens = step.read()
        self.read_wait_seconds += time.perf_counter() - started  # the device time a step did not hide
        return [token for token in tokens if not is_dead_row(token.request_id)]

    def _update_batch(
        self, rows: list[DecodeRow], rows_to_cache: dict[str, tuple[int, ...]], upcoming: list[str] | None = None
    ) -> Membership:
        """The decode batch made exactly this step's rows (leaving rows' KV cached first), rows kept vacant for
        `upcoming` joiners where it is rebuilt; where its rows come from."""
        request_ids = [row.request_id for row in rows]
        if request_ids == self.batch.request_ids and not rows_to_cache:  # the last step's rows, as they were
            return Membership(list(range(len(request_ids))))
        joiner_caches = {rid: self._prefill_caches.pop(rid) for rid in request_ids if rid not in self.batch.rows}
        blocks = {rid: self._joiner_blocks.pop(rid) for rid in joiner_caches if rid in self._joiner_blocks}
        self._cache_leaving_rows(rows_to_cache)
        shifts = self._rope_deltas if self.text_twin is not None else None  # folded into offsets for the twin
        # Joins reserve the KV positions the rows may still write (one a sample; max_tokens is resolved by now).
        room = max(((self._rows[row.request_id].params.max_tokens or 1) - row.sample_index for row in rows), default=1)
        later = Upcoming.of([self._requests[rid].sampling.max_tokens for rid in upcoming or ()],
                            self.config.max_decode_seqs - len(rows))
        return self.batch.update_membership(request_ids, joiner_caches, self._rows, blocks, shifts, room, later)

    def _dispatch_forward(
        self, rows: list[DecodeRow], rows_to_cache: dict[str, tuple[int, ...]], upcoming: list[str]
    ) -> mx.array | None:
        previous_ids = list(self.batch.request_ids)
        membership = self._update_batch(rows, rows_to_cache, upcoming)
        if not self.batch.request_ids:
            return None
        inputs = self._decode_inputs(previous_ids, membership)
        if self.text_twin is not None and self.batch.shifts_folded:  # a VLM's rows decode as text (mx.fast.rope)
            return self.text_twin(inputs[:, None], cache=self.batch.caches)[:, -1, :]
        if self._rope_deltas:
            deltas = mx.array([[self._rope_deltas.get(rid, 0)] for rid in self.batch.request_ids])
            return self.model(inputs[:, None], cache=self.batch.caches, rope_deltas=deltas)[:, -1, :]
        with self._adapter_rows.rows(self.batch.request_ids):
            return self.model(inputs[:, None], cache=self.batch.caches)[:, -1, :]

    def _sampling_graph(self, logits: mx.array | None, rows: list[DecodeRow]) -> PendingStep | None:
        """The step's sampling, built on its forward (launched by execute)."""
        if logits is None:
            return None
        sampler, steps, tops = self.batch.sampler, [], []
        if not sampler.all_greedy:  # the steps key seeded noise, which greedy rows never draw
            sample_index = {row.request_id: row.sample_index for row in rows}
            steps = [sample_index.get(rid, 0) for rid in self.batch.request_ids]  # dead rows: none
        if sampler.max_top_logprobs:
            tops = self.batch.top_logprob_counts()
        return PendingStep(list(self.batch.request_ids), sampler.sample(logits, steps), tops)

    def _decode_inputs(self, previous_ids: list[str], membership: Membership) -> mx.array:
        """Kept rows feed their pending sampled token (still lazy); joiners their first token. After a verifying
        step (nothing pending) every row's input is on the host."""
        if self._pending is None:
            return mx.array([0 if is_dead_row(rid) else self._next_inputs.pop(rid) for rid in self.batch.request_ids],
                            mx.uint32)
        assert not membership.keep_rows or self._pending.request_ids == previous_ids
        firsts = [self._next_inputs.pop(self.batch.request_ids[row]) for row in membership.joiner_rows]
        return step_inputs(self._pending.sampled.token_ids, membership, firsts, len(self.batch.request_ids))

    def _cache_leaving_rows(self, rows_to_cache: dict[str, tuple[int, ...]]) -> None:
        """Feed the KV of rows leaving the batch (prompt and generated tokens) to the prefix cache."""
        if self._blocks is None:
            return
        for row, request_id in enumerate(self.batch.request_ids):
            token_ids = rows_to_cache.get(request_id)
            if token_ids is not None:
                self._blocks.insert(token_ids, lambda row=row: self.batch.row_cache(row))

    # ---- prefill ---------------------------------------------------------
    def _dispatch_prefill(self, chunks: list[PrefillChunk]) -> PendingStep | None:
        """Queue this step's prompt chunks on the device; the completing ones' first tokens are sampled
        in the same queue (read back by _collect_first_tokens)."""
        if not chunks:
            return None
        chunks = self._text_chunks_first(chunks)
        caches = [self._prefill_cache(chunk.request_id) for chunk in chunks]
        result = self._run_prefill(chunks, caches)
        for chunk, cache in zip(chunks, result.caches):
            self._prefill_caches[chunk.request_id] = cache
            self._maybe_snapshot(chunk, cache)
        self._note_joiner_blocks(chunks, result)
        if self._copies is not None:
            prompts = [self._requests[chunk.request_id].cache_keys for chunk in chunks]
            self._copies.keep(PrefilledPrompts(chunks, prompts, result))
        if not result.completing:
            return None
        request_ids = [chunk.request_id for chunk in result.completing]
        rows = [self._row_sampling(request_id) for request_id in request_ids]
        # A resumed request's first sample continues its sample count (its seeded noise as if never preempted).
        steps = [self._requests[request_id].num_generated for request_id in request_ids]
        sampled = BatchSampler(rows, self.batch.vocab_size).sample(result.last_logits, steps)
        mx.async_eval([*sampled.arrays(), *result.kv_arrays()])
        return PendingStep(request_ids, sampled, [r.params.top_logprobs for r in rows])

    def _text_chunks_first(self, chunks: list[PrefillChunk]) -> list[PrefillChunk]:
        if self.vision_prompts is None:
            return self._adapter_rows.ordered(chunks)  # one adapter's chunks together (vision models have none)
        return self.vision_prompts.order(chunks, self._requests)

    def _run_prefill(self, chunks: list[PrefillChunk], caches: list[LayerCaches]) -> PrefillResult:
        """Text chunks batched (prefill.py); a vision model's others as vision_prefill.py runs them."""
        rows_limit = self.config.max_prefill_seqs if self.pad_prefill_shapes else None
        model, split = self._text_model()

        def run_text(text_chunks: list[PrefillChunk], text_caches: list[LayerCaches]) -> PrefillResult:
            return run_prefill(model, text_chunks, text_caches, rows_limit, self.batch.vocab_size, split)

        if self.vision_prompts is not None:
            return self.vision_prompts.run(chunks, caches, self._requests, run_text)
        return self._adapter_rows.prefill(chunks, caches, run_text) if chunks else PrefillResult([], [], None)

    def _text_model(self) -> tuple[Any, HeadSplit | None]:
        """What text prefill runs (a VLM's: its text twin, as its decode) and its head split."""
        twin = self._twin_prefill
        return (twin.model, twin.split) if twin is not None else (self.model, self.head_split)

    def _collect_first_tokens(self, step: PendingStep | None) -> list[SampledToken]:
        if step is None:
            return []
        tokens = self._read(step)
        for token in tokens:
            self._next_inputs[token.request_id] = token.token_id
        if self._history_rows:
            self.batch.record_tokens(tokens, self._rows)
        if self.speculation is not None:
            self.speculation.record(tokens)
        return tokens

    def _note_joiner_blocks(self, chunks: list[PrefillChunk], result: PrefillResult) -> None:
        for i, block in result.row_blocks().items():
            if chunks[i].completes_prefill:
                self._joiner_blocks[chunks[i].request_id] = block

    def _row_sampling(self, request_id: str) -> RowSampling:
        """A request's sampling row, made once: its seed and token history follow it into decode."""
        row = self._rows.get(request_id)
        if row is None:
            row = self._rows[request_id] = new_row_sampling(self._requests[request_id], self._guides, self._rng)
            if row.params.needs_token_history:
                self._history_rows.add(request_id)
        return row

    def _maybe_snapshot(self, chunk: PrefillChunk, cache: LayerCaches) -> None:
        """Snapshot mode: the scheduler marks chunks ending on a block boundary beyond the cached prefix."""
        if chunk.snapshot and self._blocks is not None:
            self._blocks.insert_snapshot(self._requests[chunk.request_id].cache_keys[: chunk.end], cache)

    def _prefill_cache(self, request_id: str) -> LayerCaches:
        """The request's cache, made at its first chunk from its cached prefix blocks (if any)."""
        cache = self._prefill_caches.get(request_id)
        if cache is None:
            request, store = self._requests[request_id], self._blocks
            cache = (store.request_cache(request.cached_block_hashes, request.cached_tail_tokens) if store is not None
                     else new_request_cache(self.model, self.kv_quantization))
            self._prefill_caches[request_id] = cache
        return cache

    # ---- housekeeping ----------------------------------------------------
    def release_buffers(self) -> None:
        """Hand MLX's cache of freed buffers back to the device (under load its cap bounds it), with nothing in flight:
        freeing holds the GIL and can wait for the device (py-spy: ~36 ms per 8 s of bursts on the H100)."""
        if not self.holds_state():
            mx.clear_cache()

    def speculation_stats(self) -> SpeculationStats | None:
        return self.speculation.stats() if self.speculation is not None else None

    def kv_cache_bytes(self) -> int:
        total = cache_nbytes(self.batch.caches) if self.batch.caches else 0
        return total + sum(cache_nbytes(c) for c in self._prefill_caches.values())

    def holds_state(self) -> bool:
        """True while a dispatched step is unread or any KV is still held (freed by the next step)."""
        return self._pending is not None or len(self.batch) > 0 or bool(self._prefill_caches) or bool(self._copies)

    def warmup(self) -> None:
        """Build kernels before the first request: one tiny forward, and every padded prefill shape."""
        with mx.stream(self.stream):
            model, split = self._text_model()
            warm_up_model(model, self.config, self.kv_quantization, self.pad_prefill_shapes, self.batch.vocab_size, split)
            if self.speculation is not None:
                self.speculation.calibrate()
            mx.clear_cache()

    def close(self) -> None:
        self._pending = None
        self._launch.close()
        if self.speculation is not None:
            self.speculation.close()
        for held in (self._prefill_caches, self._joiner_blocks, self._requests, self._rows, self._next_inputs,
                     self._rope_deltas):
            held.clear()
        if self._copies is not None:
            self._copies.clear()
        if self.vision_prompts is not None:
            self.vision_prompts.clear()
        if self.prefix_cache is not None:
            self.prefix_cache.evict_all_unlocked()
        self.batch.caches = []
        mx.clear_cache()
        mx.set_cache_limit(self._previous_cache_limit)
        self._memory_limit.restore()

