"""A dispatched sampling whose tokens are still on the device: read back into SampledTokens when the runner needs
them (a decode step's one step later, pipelined; a prefill's first tokens and a verification's at once)."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from engine.runner_output import SampledToken, TopLogprob
from engine.sampling.sampler import SampledBatch


@dataclass
class PendingStep:
    """A dispatched decode step whose tokens have not been read back yet."""

    request_ids: list[str]
    sampled: SampledBatch
    top_logprob_counts: list[int]

    def read(self) -> list[SampledToken]:
        mx.eval(self.sampled.arrays())
        token_ids = self.sampled.token_ids.tolist()
        logprobs = self.sampled.token_logprobs.tolist() if self.sampled.token_logprobs is not None else None
        tops = self._read_top_logprobs()
        return [
            SampledToken(rid, token_ids[i], logprobs[i] if logprobs else None, tops[i] if tops else ())
            for i, rid in enumerate(self.request_ids)
        ]

    def _read_top_logprobs(self) -> list[tuple[TopLogprob, ...]] | None:
        if self.sampled.top_ids is None:
            return None
        ids, values = self.sampled.top_ids.tolist(), self.sampled.top_logprobs.tolist()
        return [
            tuple(TopLogprob(t, v) for t, v in zip(ids[i][:n], values[i][:n]))
            for i, n in enumerate(self.top_logprob_counts)
        ]


__all__ = ["PendingStep"]
