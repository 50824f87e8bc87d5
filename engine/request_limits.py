"""RequestLimits: the checks of a request against the model's limits (vocabulary, context length, KV budget), made
once, by the engine client at submit (and by callers that drive a core directly)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from numbers import Integral

from engine.errors import ContextLengthExceededError, InvalidRequestError
from engine.kv.budget import KVBudget
from engine.request import Request
from engine.sampling.guided_regex import guided_regex


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    context_length: int
    # None: no KV budget (a request is refused only past the context length).
    kv_budget: KVBudget | None = None

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
        if request.sampling.guided is not None:
            guided_regex(request.sampling.guided)  # raises InvalidRequestError for a spec it cannot express
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
        return request
