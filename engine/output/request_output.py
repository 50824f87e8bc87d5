"""Neutral events that leave the engine; the API layer renders them as OpenAI/Anthropic."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.errors import OrchardError
from engine.request import FinishReason
from engine.runner_output import TopLogprob


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top_logprobs: tuple[TopLogprob, ...] = ()


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class TextDelta:
    """New text and the tokens behind it (text may lag tokens while a stop string is pending)."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None

    def merge(self, later: "TextDelta") -> None:
        self.text += later.text
        self.token_ids.extend(later.token_ids)
        if later.logprobs is not None:
            self.logprobs = (self.logprobs or []) + later.logprobs


@dataclass
class Finish:
    reason: FinishReason
    usage: Usage
    stop_reason: str | int | None = None


@dataclass
class RequestOutput:
    """What one engine step produced for one request."""

    request_id: str
    delta: TextDelta | None = None
    finish: Finish | None = None
    error: OrchardError | None = None

    @property
    def is_last(self) -> bool:
        return self.finish is not None or self.error is not None

    def merge(self, later: "RequestOutput") -> None:
        """Append a later step's output for the same request (a consumer that fell behind takes both at once)."""
        if later.delta is not None:
            if self.delta is None:
                self.delta = later.delta
            else:
                self.delta.merge(later.delta)
        self.finish = later.finish or self.finish
        self.error = later.error or self.error

    @property
    def new_token_ids(self) -> list[int]:
        return self.delta.token_ids if self.delta is not None else []
