"""What leaves the engine for a request: neutral events (Queued, Admitted, TextDelta, Finish, errors) that the API layer renders
as OpenAI/Anthropic, and RequestOutputState, which turns a request's sampled tokens into them (detokenizing, stops)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from engine.errors import OrchardError
from engine.output.detokenizer import IncrementalDetokenizer, TextSource
from engine.request import FINISH_REASON_OF_STATUS, FinishReason, Request, RequestStatus
from engine.runner_output import SampledToken, TopLogprob


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
    # Speculative decoding: draft tokens the model accepted and rejected (OpenAI's prediction token counts).
    accepted_draft_tokens: int = 0
    rejected_draft_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Queued:
    """The engine accepted the request into its queue (past the queue-size check); it may still wait there for a
    free slot or for other prompts' prefill. A stream can open now, so clients see bytes while it waits."""


@dataclass(frozen=True)
class Admitted:
    """The scheduler took the request in (past the queue's checks; its prefix-cache match made): its prefill
    starts now. Sent before its first token, so a stream can open while a long prompt is prefilled."""

    prompt_tokens: int
    cached_tokens: int  # of prompt_tokens, read from the prefix cache (counted in usage the same way)


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
    admitted: Admitted | None = None  # comes before any delta of the request
    queued: Queued | None = None  # comes before its admission

    @property
    def is_last(self) -> bool:
        return self.finish is not None or self.error is not None

    def merge(self, later: "RequestOutput") -> None:
        """Append a later step's output for the same request (a consumer that fell behind takes both at once)."""
        self.queued = self.queued or later.queued
        self.admitted = self.admitted or later.admitted
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


@dataclass
class TokenVerdict:
    output: RequestOutput
    finished_status: RequestStatus | None = None


class RequestOutputState:
    def __init__(
        self, request: Request, text_source: Callable[[bool], TextSource], eos_token_ids: frozenset[int]
    ) -> None:
        self.request = request
        params = request.sampling
        # A guided request always ends at EOS: its guide only allows EOS once the text is complete.
        keep_eos = params.ignore_eos and params.guided is None
        self._stop_ids = frozenset(params.stop_token_ids) | (frozenset() if keep_eos else eos_token_ids)
        self._detokenizer = IncrementalDetokenizer(text_source(params.skip_special_tokens), params.stop)

    def on_token(self, sampled: SampledToken) -> TokenVerdict:
        request = self.request
        request.append_output_token(sampled.token_id)
        logprobs = self._logprobs(sampled)
        if sampled.token_id in self._stop_ids:
            # The stop token is counted in usage but, like its (absent) text, not in logprobs.
            request.stop_reason = sampled.token_id
            return self._finish(RequestStatus.FINISHED_STOPPED, "", sampled, None)
        check = self._detokenizer.add_token(sampled.token_id)
        if check.stop is not None:
            request.stop_reason = check.stop
            return self._finish(RequestStatus.FINISHED_STOPPED, check.text, sampled, logprobs, flush=False)
        if request.num_output_tokens >= request.max_tokens:
            return self._finish(RequestStatus.FINISHED_LENGTH, check.text, sampled, logprobs)
        delta = TextDelta(check.text, [sampled.token_id], logprobs)
        return TokenVerdict(RequestOutput(request.request_id, delta=delta))

    def _finish(
        self,
        status: RequestStatus,
        text: str,
        sampled: SampledToken,
        logprobs: list[TokenLogprob] | None,
        flush: bool = True,
    ) -> TokenVerdict:
        if flush:
            tail = self._detokenizer.finish()
            text += tail.text
            if tail.stop is not None:
                status, self.request.stop_reason = RequestStatus.FINISHED_STOPPED, tail.stop
        delta = TextDelta(text, [sampled.token_id], logprobs)
        finish = self.finish_event(status)
        return TokenVerdict(RequestOutput(self.request.request_id, delta=delta, finish=finish), status)

    def finish_event(self, status: RequestStatus) -> Finish:
        return Finish(FINISH_REASON_OF_STATUS[status], self.usage(), self.request.stop_reason)

    def admitted(self) -> Admitted:
        return Admitted(self.request.num_prompt_tokens, self.request.num_cached_tokens)

    def usage(self) -> Usage:
        request = self.request
        accepted = request.num_accepted_draft_tokens
        return Usage(
            request.num_prompt_tokens, request.num_output_tokens, request.num_cached_tokens,
            accepted, request.num_drafted_tokens - accepted,
        )

    def _logprobs(self, sampled: SampledToken) -> list[TokenLogprob] | None:
        if not self.request.sampling.logprobs:
            return None
        return [TokenLogprob(sampled.token_id, sampled.logprob, sampled.top_logprobs)]
