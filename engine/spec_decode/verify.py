"""Verification of a batch's drafts by the target's own sampler, row by row and position by position.

Drafts are deterministic (prompt lookup, a draft model's greedy choice), so a draft token d stands for a
one-hot q; the standard rejection rule then accepts d with probability p(d) and, on rejection, samples from
p with d removed. Sampling the target at each position, with the noise plain decode would use at that
step, and accepting while the sample equals the draft does exactly that, and more: a seeded row writes the
very tokens (and logprobs) it writes without speculation. Penalties see the drafts before each position.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

import mlx.core as mx

from engine.runner_output import SampledToken
from engine.sampling.pending_step import PendingStep
from engine.sampling.sampler import BatchSampler, RowSampling, SampledBatch


@dataclass(frozen=True)
class VerifyRow:
    """One decode row of a verifying step: its sampling row, first sample index and drafts (maybe none)."""

    request_id: str
    sampling: RowSampling
    sample_index: int
    num_drafts: int


@dataclass
class VerifyStep:
    """A dispatched verification: [rows x width] samples (lazy) and the drafts they are compared with."""

    rows: list[VerifyRow]
    width: int
    sampled: SampledBatch
    drafts: mx.array  # [rows, width - 1] uint32 (unused columns: anything)
    top_logprob_counts: list[int]


def position_rows(row: VerifyRow, draft_tokens: list[int] | None, width: int) -> list[RowSampling]:
    """The sampling row at each of a row's positions: its own at 0; past it, penalties count the drafts before."""
    own = row.sampling
    if own.guide is not None:
        own_without_guide = replace(own, guide=None)  # guided rows never draft: their later positions are padding
        return [own] + [own_without_guide] * (width - 1)
    if not own.params.has_penalties or draft_tokens is None:
        return [own] * width
    rows = [own]
    counts = Counter(own.generated_counts)
    for position in range(1, width):
        if position <= len(draft_tokens):
            counts[draft_tokens[position - 1]] += 1
        rows.append(replace(own, generated_counts=Counter(counts)))
    return rows


def dispatch_verification(
    logits: mx.array, rows: list[VerifyRow], drafts: mx.array, host_drafts: dict[str, list[int]], vocab_size: int
) -> VerifyStep:
    """Sample every position of every row ([B, width, V] logits); the rows' drafts ride along to the read-back.
    host_drafts: drafts known on the host (penalised rows need them before sampling)."""
    width = logits.shape[1]
    sampling, steps = [], []
    for row in rows:
        sampling += position_rows(row, host_drafts.get(row.request_id), width)
        steps += [row.sample_index + j for j in range(width)]
    sampler = BatchSampler(sampling, vocab_size)
    sampled = sampler.sample(logits.reshape(len(rows) * width, logits.shape[-1]), steps)
    mx.async_eval([*sampled.arrays(), drafts])
    counts = [row.sampling.params.top_logprobs for row in rows for _ in range(width)]
    return VerifyStep(rows, width, sampled, drafts, counts)


@dataclass(frozen=True)
class VerifiedRow:
    request_id: str
    tokens: list[SampledToken]  # the accepted drafts, then the target's own token
    num_drafts: int
    num_accepted: int


def read_verification(step: VerifyStep) -> list[VerifiedRow]:
    """Each row's accepted drafts and the target's token after them (one read-back for the whole batch)."""
    width = step.width
    request_ids = [row.request_id for row in step.rows for _ in range(width)]
    sampled = PendingStep(request_ids, step.sampled, step.top_logprob_counts).read()
    drafts = step.drafts.tolist() if width > 1 else [[] for _ in step.rows]
    verified = []
    for i, row in enumerate(step.rows):
        tokens = sampled[i * width : (i + 1) * width]
        accepted = 0
        while accepted < row.num_drafts and tokens[accepted].token_id == drafts[i][accepted]:
            accepted += 1
        verified.append(VerifiedRow(row.request_id, tokens[: accepted + 1], row.num_drafts, accepted))
    return verified
