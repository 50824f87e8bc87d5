"""The runner's verifying decode steps: draft, check every row's drafts in the batch's one forward, roll back.

A step verifies when some row's policy drafts (spec_decode/adaptive.py). Its drafts continue the previous
step's tokens, so that step is read back first (the decode pipeline waits once). Every row of the batch then
computes 1 + K positions (K: the longest draft; rows with fewer drafts, or none, pad), the target samples each
position (spec_decode/verify.py), and each row's KV drops what it did not accept: a lone row's cache is
trimmed, a batch's rows are cut back together and shifted where they differ (kv/plain_batch.py). Only models
whose layers are all plain KV caches speculate (others, and vision models, decode plainly).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Callable

import mlx.core as mx

from engine.kv.batch_cache import new_request_cache
from engine.kv.plain_batch import drop_row_tails
from engine.kv.whole_buffer import builds_attention_per_shape, forward_caches
from engine.runner.decode_batch import DecodeBatch
from engine.runner_output import RunnerOutput, SampledToken
from engine.sampling.sampler import RowSampling
from engine.scheduler_output import DecodeRow, NewRequest, SchedulerOutput
from engine.spec_decode.adaptive import default_max_verify_tokens, fit_lengths
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.draft_model import DraftModel
from engine.spec_decode.speculator import SpeculationStats, Speculator
from engine.spec_decode.step_costs import StepCosts
from engine.spec_decode.verify import VerifiedRow, VerifyRow, VerifyStep, dispatch_verification, read_verification

logger = logging.getLogger(__name__)


class SpeculativeDecoder:
    def __init__(
        self, model, config: SpeculativeConfig, vocab_size: int, max_verify_tokens: int, draft: DraftModel | None = None,
    ) -> None:
        self.model = model
        self.vocab_size = vocab_size
        self.draft = draft
        self.speculator = Speculator(config, max_verify_tokens, StepCosts())
        # Pad every verifying forward to the widest draft length (None: where attention builds per shape).
        self.pad_widths: bool | None = None

    # ---- rows ------------------------------------------------------------
    def add(self, request: NewRequest) -> None:
        if request.speculative and request.guide_key is None:
            self.speculator.add(request.request_id, request.prompt_token_ids)

    def forget(self, request_id: str) -> None:
        self.speculator.forget(request_id)
        if self.draft is not None:
            self.draft.forget(request_id)

    def record(self, tokens: list[SampledToken]) -> None:
        for token in tokens:
            self.speculator.record_tokens(token.request_id, [token.token_id])

    # ---- a step ----------------------------------------------------------
    def plan(self, rows: list[DecodeRow], sampling: dict[str, RowSampling]) -> dict[str, int] | None:
        """Each row's draft length this step, or None when no row drafts (a plain, pipelined step)."""
        allowances = {}
        for row in rows:
            allowance = row.max_draft_tokens
            if self.draft is not None and sampling[row.request_id].params.has_penalties:
                allowance = 0  # a draft model's drafts stay on the device; penalties need them on the host
            allowances[row.request_id] = allowance
        lengths = self.speculator.plan(allowances, len(rows))
        return lengths if any(lengths.values()) else None

    def dispatch(
        self, batch: DecodeBatch, inputs: list[int], lengths: dict[str, int], rows: list[DecodeRow]
    ) -> VerifyStep:
        """Queue the drafts, the verifying forward and its sampling (batch rows' order; inputs: their last tokens)."""
        request_ids = batch.request_ids
        drafts, num_drafts, host_drafts = self._drafts(request_ids, lengths)
        drafts = self._stable_width(drafts, batch)
        tokens = mx.array(inputs, mx.uint32)[:, None]
        if drafts is not None:
            tokens = mx.concatenate([tokens, drafts], axis=1)
        logits = self.model(tokens, cache=forward_caches(batch.caches, tokens.shape[1]))
        sample_index = {row.request_id: row.sample_index for row in rows}
        verify_rows = [
            VerifyRow(rid, batch.rows[rid], sample_index[rid], n) for rid, n in zip(request_ids, num_drafts)
        ]
        empty = mx.zeros((len(request_ids), 0), mx.uint32)
        return dispatch_verification(logits, verify_rows, drafts if drafts is not None else empty, host_drafts, self.vocab_size)

    def _stable_width(self, drafts: mx.array | None, batch: DecodeBatch) -> mx.array | None:
        """Drafts padded to the widest the batch may verify, where attention builds a graph per shape (the padded
        positions cost next to nothing there, a new width's graph ~50 ms); unchanged elsewhere."""
        pad = self.pad_widths if self.pad_widths is not None else builds_attention_per_shape(batch.caches[0].keys.dtype)
        if drafts is None or not pad:
            return drafts
        widest = fit_lengths([self.speculator.config.num_draft_tokens], len(batch.request_ids), self.speculator.max_verify_tokens)[0]
        missing = widest - drafts.shape[1]
        return mx.concatenate([drafts, mx.zeros((drafts.shape[0], missing), mx.uint32)], axis=1) if missing > 0 else drafts

    def _drafts(self, request_ids: list[str], lengths: dict[str, int]) -> tuple[mx.array | None, list[int], dict[str, list[int]]]:
        """[B, K] drafts in batch order (None: no row drafts), each row's draft count, and the host's copy (n-gram)."""
        if self.draft is None:
            host = self.speculator.ngram_drafts({rid: lengths.get(rid, 0) for rid in request_ids})
            width = max((len(d) for d in host.values()), default=0)
            if width == 0:
                return None, [0] * len(request_ids), {}
            padded = [host.get(rid, []) + [0] * (width - len(host.get(rid, []))) for rid in request_ids]
            return mx.array(padded, mx.uint32), [len(host.get(rid, [])) for rid in request_ids], host
        histories = self.speculator.histories(rid for rid in request_ids if lengths.get(rid, 0) > 0)
        drafted_ids, drafted = self.draft.propose({rid: lengths[rid] for rid in histories}, histories)
        if drafted is None:
            return None, [0] * len(request_ids), {}
        position = {rid: i for i, rid in enumerate(drafted_ids)}
        padded = mx.concatenate([drafted, mx.zeros((1, drafted.shape[1]), mx.uint32)])
        order = mx.array([position.get(rid, len(drafted_ids)) for rid in request_ids], mx.int32)
        counts = [lengths[rid] if rid in position else 0 for rid in request_ids]
        return padded[order], counts, {}

    def finish(self, batch: DecodeBatch, step: VerifyStep) -> list[VerifiedRow]:
        """Read the verification back, drop each row's unaccepted positions, and learn from the outcome."""
        verified = read_verification(step)
        drops = [step.width - 1 - row.num_accepted for row in verified]
        if any(drops):
            if batch.is_batched:
                batch.padding = drop_row_tails(batch.caches, batch.padding, drops)
            else:
                for layer in batch.caches:
                    layer.trim(drops[0])
        if step.width > 1:
            self.speculator.stats.verify_steps += 1
        for row in verified:
            self.speculator.record_verification(row.request_id, row.num_drafts, row.num_accepted)
            if self.draft is not None and row.num_drafts:
                self.draft.accepted(row.request_id, row.num_accepted)
            self.record(row.tokens)
        return verified

    def calibrate(self) -> None:
        """Time a single-position forward against a verifying-width one, each at new KV lengths, before the first
        request, through the caches the verifying forward uses: a backend that builds kernels or attention graphs per
        shape, beyond what engine/kv/whole_buffer.py avoids, starts with speculation priced in."""
        config = self.speculator.config
        if not config.adaptive:
            return
        width = 1 + config.num_draft_tokens
        cache = new_request_cache(self.model)
        mx.eval(self.model(mx.zeros((1, 64), mx.uint32), cache=cache))

        def timed(positions: int) -> float:
            started = time.perf_counter()
            mx.eval(self.model(mx.zeros((1, positions), mx.uint32), cache=forward_caches(cache, positions)))
            for layer in cache:
                layer.trim(positions - 1)  # one position longer each call: always a new length
            return time.perf_counter() - started

        timed(1), timed(width)  # each path's first use builds what any length needs
        one = min(timed(1) for _ in range(3))
        many = sorted(timed(width) for _ in range(3))[1]
        self.speculator.costs.calibrate(one, many, width)
        logger.info("speculative decoding: a %d-position forward costs %.2f ms against %.2f ms for one", width, many * 1e3, one * 1e3)

    def observe_step(self, num_rows: int, width: int, seconds: float, pipelined: bool = True) -> None:
        """A decode step's wall time (width 1: plain; more: verifying), for the draft policy's costs."""
        costs = self.speculator.costs
        if width > 1:
            costs.observe_verify(num_rows, width, seconds)
        else:
            costs.observe_plain(num_rows, seconds, pipelined)

    def stats(self) -> SpeculationStats:
        """A copy of the counts, with the verify overhead the costs hold now."""
        return replace(self.speculator.stats, verify_overhead=self.speculator.costs.sync_cost)

    def close(self) -> None:
        if self.draft is not None:
            self.draft.close()


def execute_verifying(
    runner, scheduled: SchedulerOutput, lengths: dict[str, int], before_device_work: Callable[[], None] | None
) -> RunnerOutput:
    """ModelRunner.execute's step whose rows verify drafts, through the runner's parts (runner.py, which imports
    this module): synchronous, its tokens read back before it ends."""
    started = time.perf_counter()
    first = runner._dispatch_prompts(scheduled.prefill_chunks)
    sampled = runner._read_pending()
    for token in sampled:  # the drafts continue these: they are the rows' inputs now
        runner._next_inputs[token.request_id] = token.token_id
    rows, batch, speculation = scheduled.decode_rows, runner.batch, runner.speculation
    runner._update_batch(rows, scheduled.rows_to_cache)
    inputs = [runner._next_inputs.pop(rid) for rid in batch.request_ids]
    with runner._adapter_rows.rows(batch.request_ids):
        step = speculation.dispatch(batch, inputs, lengths, rows)
    if before_device_work is not None:
        before_device_work()
    if runner._blocks is not None:
        runner._blocks.flush()
    first_tokens = runner._collect_first_tokens(first)
    verified = speculation.finish(batch, step)
    if not scheduled.prefill_chunks:
        speculation.observe_step(len(rows), step.width, time.perf_counter() - started)
    tokens = [token for row in verified for token in row.tokens]
    batch.record_tokens(tokens, runner._rows)
    for row in verified:
        runner._next_inputs[row.request_id] = row.tokens[-1].token_id
    accepted = {row.request_id: row.num_accepted for row in verified if row.num_accepted}
    drafted = {row.request_id: row.num_drafts for row in verified if row.num_drafts}
    return RunnerOutput(
        sampled + tokens + first_tokens, num_first_tokens=len(first_tokens), accepted_drafts=accepted, drafted=drafted
    )


def new_speculative_decoder(loaded, config: SpeculativeConfig | None, draft_loaded=None) -> SpeculativeDecoder | None:
    """The decoder for a model's speculative config, or None where the model cannot speculate: models whose
    layers are not all plain KV caches (sliding windows, recurrent or hybrid layers) decode plainly."""
    from engine.kv.plain_batch import is_plain_request_cache
    from engine.spec_decode.draft_model import check_same_tokenizer

    if config is None:
        return None
    if not is_plain_request_cache(new_request_cache(loaded.model)):
        logger.warning("speculative decoding is off for %s: its caches are not all plain KV caches", loaded.path)
        return None
    draft = None
    if config.method == "draft":
        if draft_loaded is None:
            raise ValueError("speculative method 'draft' needs the draft model loaded")
        check_same_tokenizer(loaded.tokenizer, draft_loaded.tokenizer)
        draft = DraftModel(draft_loaded.model, loaded.vocab_size)
    max_verify = config.max_verify_tokens or default_max_verify_tokens(mx.default_device().type == mx.gpu)
    return SpeculativeDecoder(loaded.model, config, loaded.vocab_size, max_verify, draft)
