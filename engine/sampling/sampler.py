"""Batched sampling over one decode step's logits (MLX).

Every row has its own parameters; the work stays vectorised across the batch and
each optional stage (penalties, bias, top-k/p, min-p, top logprobs) costs nothing
unless some row asks for it. Random rows use counter-based noise hashed from
(seed, step, token id), so a seeded request samples the same tokens whatever
its batch neighbours are.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property

import mlx.core as mx
import numpy as np

from engine.sampling.params import SamplingParams
from engine.sampling.structured import GuideState


@dataclass
class RowSampling:
    """One batch row's sampling parameters plus the history its penalties and guide need."""

    params: SamplingParams
    seed: int  # uint32
    prompt_token_set: frozenset[int] = frozenset()
    generated_counts: Counter = field(default_factory=Counter)
    guide: GuideState | None = None  # structured output: where the text so far leaves the automaton

    def record(self, token_id: int) -> None:
        """A token this row really sampled: count it for penalties, advance the guide."""
        if self.params.has_penalties:
            self.generated_counts[token_id] += 1
        if self.guide is not None:
            self.guide.advance(token_id)


@dataclass
class SampledBatch:
    """Lazy results of one step; `read()` turns them into Python values."""

    token_ids: mx.array
    # None when no row asked for logprobs (saves the log-softmax on every step).
    token_logprobs: mx.array | None = None
    top_ids: mx.array | None = None
    top_logprobs: mx.array | None = None

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.token_ids, self.token_logprobs, self.top_ids, self.top_logprobs) if a is not None]


def _hash_uniform(seeds: mx.array, steps: mx.array, vocab_size: int) -> mx.array:
    """Uniform (0, 1) noise of shape [B, V] from a murmur3-style integer hash."""
    token_ids = mx.arange(vocab_size, dtype=mx.uint32)[None, :]
    x = seeds[:, None] * mx.array(0x9E3779B1, mx.uint32)
    x = x ^ (steps[:, None] * mx.array(0x85EBCA77, mx.uint32))
    x = x ^ (token_ids * mx.array(0xC2B2AE3D, mx.uint32))
    x = x ^ (x >> 16)
    x = x * mx.array(0x85EBCA6B, mx.uint32)
    x = x ^ (x >> 13)
    x = x * mx.array(0xC2B2AE35, mx.uint32)
    x = x ^ (x >> 16)
    uniform = ((x >> 8).astype(mx.float32) + 0.5) * (1.0 / (1 << 24))
    # The top value rounds to 1.0 in float32, whose Gumbel noise is +inf: it would beat every
    # logit, even a masked (-inf) one. Clamp to the largest float32 below 1.
    return mx.minimum(uniform, mx.array(1.0 - 2.0**-24, mx.float32))


@dataclass(frozen=True)
class RowParamArrays:
    """The batch rows' sampling parameters as device arrays, in row order."""

    temperatures: mx.array
    seeds: mx.array
    top_ks: mx.array  # 0 (off) and any k above the vocabulary stand as the vocabulary size
    top_ps: mx.array
    min_ps: mx.array

    @classmethod
    def of(cls, rows: list[RowSampling], vocab_size: int) -> "RowParamArrays":
        params = [r.params for r in rows]
        return cls(
            temperatures=mx.array([float(p.temperature) for p in params], mx.float32),  # an int past int64 casts badly
            seeds=mx.array([r.seed for r in rows], mx.uint32),
            top_ks=mx.array([_kept_by_top_k(p.top_k, vocab_size) for p in params], mx.int32),
            top_ps=mx.array([p.top_p for p in params], mx.float32),
            min_ps=mx.array([p.min_p for p in params], mx.float32),
        )


def _kept_by_top_k(top_k: int, vocab_size: int) -> int:
    """How many tokens a row's top-k keeps: all of them when it is off or at least the vocabulary (the k-th
    largest logit is then read inside the row, never past its end)."""
    return min(top_k, vocab_size) if top_k > 0 else vocab_size


class BatchSampler:
    """Sampling parameters of the current decode batch as arrays; rebuilt when rows change."""

    def __init__(self, rows: list[RowSampling], vocab_size: int) -> None:
        self.rows = rows
        self.vocab_size = vocab_size
        params = [r.params for r in rows]
        self.all_greedy = all(p.is_greedy for p in params)
        self.uses_top_k = any(0 < p.top_k < vocab_size for p in params)
        self.uses_top_p = any(p.top_p < 1.0 for p in params)
        self.uses_min_p = any(p.min_p > 0.0 for p in params)
        self.max_top_logprobs = max((p.top_logprobs for p in params), default=0)
        self.wants_logprobs = any(p.logprobs for p in params)
        self.penalised_rows = [i for i, p in enumerate(params) if p.has_penalties]
        self.guided_rows = [i for i, r in enumerate(rows) if r.guide is not None]
        self._bias = self._build_bias(params)

    @cached_property
    def arrays(self) -> RowParamArrays:
        """Made on first use: the batch is rebuilt whenever rows join or leave, and an all-greedy
        batch (the common case) never needs them."""
        return RowParamArrays.of(self.rows, self.vocab_size)

    @cached_property
    def _guided_row_ids(self) -> mx.array:
        return mx.array(self.guided_rows, mx.int32)

    @cached_property
    def _bit_shifts(self) -> mx.array:
        return mx.arange(32, dtype=mx.int32)

    @property
    def needs_token_history(self) -> bool:
        return bool(self.penalised_rows or self.guided_rows)

    def _build_bias(self, params: list[SamplingParams]) -> tuple[mx.array, mx.array] | None:
        flat_ids, values = [], []
        for row, p in enumerate(params):
            for token_id, bias in p.logit_bias:
                flat_ids.append(row * self.vocab_size + token_id)
                values.append(bias)
        if not flat_ids:
            return None
        return mx.array(flat_ids, mx.int64), mx.array(values, mx.float32)

    def sample(self, logits: mx.array, steps: list[int]) -> SampledBatch:
        """logits: [B, V] of the model; steps: each row's decode step index (for seeded noise)."""
        if self.all_greedy and self._bias is None and not self.needs_token_history and not self.wants_logprobs:
            # The common fast path: one argmax kernel, in the model's dtype.
            return SampledBatch(mx.argmax(logits, axis=-1).astype(mx.uint32))
        logits = logits.astype(mx.float32)
        # Penalties and guides assign into their input: give them their own array, so that the
        # logprobs below stay the model's own distribution.
        processed = self._apply_processors(mx.array(logits) if self.needs_token_history else logits)
        result = SampledBatch(self._choose_tokens(processed, steps))
        if self.wants_logprobs:
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            result.token_logprobs = mx.take_along_axis(logprobs, result.token_ids[:, None], axis=-1)[:, 0]
            if self.max_top_logprobs:
                result.top_ids, result.top_logprobs = self._top_logprobs(logprobs)
        return result

    def _apply_processors(self, logits: mx.array) -> mx.array:
        if self._bias is not None:
            flat_ids, values = self._bias
            flat = logits.reshape(-1)
            flat = flat.at[flat_ids].add(values)
            logits = flat.reshape(logits.shape)
        if self.penalised_rows:
            logits = self._apply_penalties(logits)
        if self.guided_rows:
            logits = self._apply_guides(logits)
        return logits

    def _apply_guides(self, logits: mx.array) -> mx.array:
        """-inf for tokens the guided rows' automata forbid; other rows are not touched (exact)."""
        vocab = logits.shape[-1]
        words = self.rows[self.guided_rows[0]].guide.compiled.mask_words
        bits = np.empty((len(self.guided_rows), words), dtype=np.int32)
        for i, row in enumerate(self.guided_rows):
            self.rows[row].guide.write_mask(bits[i])
        # Unpack the bitmasks on the device: [G, words, 32] bits -> [G, vocab] booleans.
        allowed = ((mx.array(bits)[:, :, None] >> self._bit_shifts) & 1).reshape(len(bits), words * 32)[:, :vocab]
        neg_inf = mx.array(-float("inf"), logits.dtype)
        if len(self.guided_rows) == logits.shape[0]:
            return mx.where(allowed.astype(mx.bool_), logits, neg_inf)
        rows = self._guided_row_ids
        logits[rows] = mx.where(allowed.astype(mx.bool_), logits[rows], neg_inf)
        return logits

    def _apply_penalties(self, logits: mx.array) -> mx.array:
        rows, cols, rep, pres, freq, counts = [], [], [], [], [], []
        for row in self.penalised_rows:
            state = self.rows[row]
            p = state.params
            tokens = set(state.generated_counts)
            if p.repetition_penalty != 1.0:
                tokens |= state.prompt_token_set
            for token_id in tokens:
                rows.append(row)
                cols.append(token_id)
                rep.append(float(p.repetition_penalty))  # 10**20 is a valid penalty; MLX cannot cast that int
                pres.append(float(p.presence_penalty))
                freq.append(float(p.frequency_penalty))
                counts.append(state.generated_counts.get(token_id, 0))
        if not rows:
            return logits
        row_ids, col_ids = mx.array(rows), mx.array(cols)
        picked = logits[row_ids, col_ids]
        rep_a = mx.array(rep, mx.float32)
        count_a = mx.array(counts, mx.float32)
        adjusted = mx.where(picked > 0, picked / rep_a, picked * rep_a)
        adjusted = adjusted - mx.array(pres, mx.float32) * (count_a > 0) - mx.array(freq, mx.float32) * count_a
        logits[row_ids, col_ids] = adjusted
        return logits

    def _choose_tokens(self, logits: mx.array, steps: list[int]) -> mx.array:
        greedy = mx.argmax(logits, axis=-1).astype(mx.uint32)
        if self.all_greedy:
            return greedy
        temps = mx.maximum(self.arrays.temperatures, 1e-6)[:, None]
        scaled = self._filter(logits / temps)
        uniform = _hash_uniform(self.arrays.seeds, mx.array(steps, mx.uint32), logits.shape[-1])
        gumbel = -mx.log(-mx.log(uniform))
        sampled = mx.argmax(scaled + gumbel, axis=-1).astype(mx.uint32)
        return mx.where(self.arrays.temperatures == 0.0, greedy, sampled)

    def _filter(self, scaled: mx.array) -> mx.array:
        """Mask tokens outside top-k / top-p / min-p with -inf (rows that ask for them)."""
        neg_inf = mx.array(-float("inf"), scaled.dtype)
        if self.uses_min_p:
            probs = mx.softmax(scaled, axis=-1)
            threshold = mx.max(probs, axis=-1, keepdims=True) * self.arrays.min_ps[:, None]
            scaled = mx.where(probs < threshold, neg_inf, scaled)
        if self.uses_top_k or self.uses_top_p:
            sorted_desc = -mx.sort(-scaled, axis=-1)
            if self.uses_top_k:
                kth = mx.take_along_axis(sorted_desc, (self.arrays.top_ks - 1)[:, None], axis=-1)
                scaled = mx.where(scaled < kth, neg_inf, scaled)
                sorted_desc = mx.where(mx.arange(scaled.shape[-1])[None] < self.arrays.top_ks[:, None], sorted_desc, neg_inf)
            if self.uses_top_p:
                scaled = self._top_p(scaled, sorted_desc, neg_inf)
        return scaled

    def _top_p(self, scaled: mx.array, sorted_desc: mx.array, neg_inf: mx.array) -> mx.array:
        sorted_probs = mx.softmax(sorted_desc, axis=-1)
        mass_before = mx.cumsum(sorted_probs, axis=-1) - sorted_probs
        # Keep each token whose preceding mass is below top_p; the threshold is the last kept logit.
        keep = mass_before < self.arrays.top_ps[:, None]
        # At least the top token: a top_p that rounds to 0 in float32 keeps none, and index -1 is outside the row.
        last_kept = mx.maximum(mx.sum(keep, axis=-1, keepdims=True) - 1, 0)
        threshold = mx.take_along_axis(sorted_desc, last_kept, axis=-1)
        return mx.where(scaled < threshold, neg_inf, scaled)

    def _top_logprobs(self, logprobs: mx.array) -> tuple[mx.array, mx.array]:
        k = self.max_top_logprobs
        top_ids = mx.argpartition(-logprobs, k - 1, axis=-1)[:, :k]
        top_values = mx.take_along_axis(logprobs, top_ids, axis=-1)
        order = mx.argsort(-top_values, axis=-1)
        return mx.take_along_axis(top_ids, order, axis=-1), mx.take_along_axis(top_values, order, axis=-1)
