"""Request checks that need only the model's limits: the engine core runs them, and so does the serving
process in front of an engine in a child process (so that a bad request is refused before it is sent)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine.errors import ContextLengthExceededError, InvalidRequestError
from engine.request import Request
from engine.sampling.guided_regex import guided_regex


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    context_length: int

    def validate(self, request: Request) -> Request:
        """Check a request (any thread); returns it with max_tokens resolved against the context length."""
        num_prompt = request.num_prompt_tokens
        if num_prompt == 0:
            raise InvalidRequestError("The prompt is empty", param="prompt")
        if any(not 0 <= t < self.vocab_size for t in request.prompt_token_ids):
            raise InvalidRequestError("The prompt holds token ids outside the vocabulary", param="prompt")
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
            request.sampling = replace(request.sampling, max_tokens=room)
        return request
