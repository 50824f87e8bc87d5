"""RequestLimits: the checks of a request against the model's limits (vocabulary, context length, KV budget), made
once, by the engine client at submit (and by callers that drive a core directly)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from numbers import Integral

from engine.errors import ContextLengthExceededError, InvalidRequestError
from engine.kv.budget import KVBudget
from engine.request import Request
from engine.sampling.guided import GuidedDecoding
from engine.sampling.guide_limits import OutputReach, bound_guide, check_regex_size
from engine.sampling.guided_regex import guided_regex


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    context_length: int
    # None: no KV budget (a request is refused only past the context length).
    kv_budget: KVBudget | None = None
    # The most characters one token writes: with max_tokens, how long a structured output can ever be.
    token_chars: int = 64

    def validate(self, request: Request) -> Request:
        """Check a request (any thread); returns it with max_tokens resolved against the context length."""
        num_prompt = request.num_prompt_tokens
        if num_prompt == 0:
            raise InvalidRequestError("The prompt is empty", param="prompt")
        if any(not isinstance(t, Integral) or not 0 <= t < self.vocab_size for t in request.prompt_token_ids):
            raise InvalidRequestError(
                f"The prompt holds token ids outside the vocabulary (0..{self.vocab_size - 1})", param="prompt"
            )
        request.sampling.validate(self.vocab_size)
        max_tokens = request.sampling.max_tokens
        room = self.context_length - num_prompt
        if room < 1 or (max_tokens is not None and max_tokens > room):
            wanted = num_prompt + (max_tokens or 1)
            raise ContextLengthExceededError(
                f"This model's maximum context length is {self.context_length} tokens, but the request "
                f"needs {wanted} ({num_prompt} in the prompt + {max_tokens or 1} to generate)",
                param="max_tokens" if room >= 1 else "messages",
            )
        if max_tokens is None:
            max_tokens = room
            if self.kv_budget is not None:  # like the context, the budget bounds an unbounded request
                max_tokens = max(1, min(room, self.kv_budget.max_request_tokens - num_prompt))
            request.sampling = replace(request.sampling, max_tokens=max_tokens)
        if self.kv_budget is not None:
            self.kv_budget.check_fits_alone(num_prompt, max_tokens)
        if request.sampling.guided is not None:
            request.sampling = replace(request.sampling, guided=self._bounded_guide(request.sampling.guided, max_tokens))
        return request

    def _bounded_guide(self, guided: GuidedDecoding, max_tokens: int) -> GuidedDecoding:
        """The constraint within the server's limits and what max_tokens can reach (guide_limits.py), checked
        before anything compiles it; raises InvalidRequestError for one it cannot or may not express."""
        reach = OutputReach(max_tokens, self.token_chars)
        guided = bound_guide(guided, reach)
        check_regex_size(guided_regex(guided), guided.param, reach)
        return guided
