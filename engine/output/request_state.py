"""Turns sampled tokens into text deltas and finish decisions for one request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from engine.output.detokenizer import IncrementalDetokenizer, TextSource
from engine.output.request_output import Finish, RequestOutput, TextDelta, TokenLogprob, Usage
from engine.request import FINISH_REASON_OF_STATUS, Request, RequestStatus
from engine.runner_output import SampledToken


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

    def usage(self) -> Usage:
        request = self.request
        return Usage(request.num_prompt_tokens, request.num_output_tokens, request.num_cached_tokens)

    def _logprobs(self, sampled: SampledToken) -> list[TokenLogprob] | None:
        if not self.request.sampling.logprobs:
            return None
        return [TokenLogprob(sampled.token_id, sampled.logprob, sampled.top_logprobs)]
