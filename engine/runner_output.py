"""What the runner hands back to the engine core each step: the sampled tokens (plain data, no MLX)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    logprob: float


@dataclass(slots=True)  # not frozen: a frozen init costs ~0.9 us against 0.26, made for every row of every step
class SampledToken:
    request_id: str
    token_id: int
    logprob: float | None  # None unless the request asked for logprobs
    top_logprobs: tuple[TopLogprob, ...] = ()


@dataclass
class RunnerOutput:
    sampled: list[SampledToken] = field(default_factory=list)
    # How many of `sampled` are first tokens of prompts completed this step (they come last).
    num_first_tokens: int = 0
    # Rows of a verifying step that accepted drafts: how many (their KV holds these beyond the scheduled token).
    accepted_drafts: dict[str, int] = field(default_factory=dict)
    # Rows of a verifying step that drafted: how many tokens.
    drafted: dict[str, int] = field(default_factory=dict)
