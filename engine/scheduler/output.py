"""The contract between the scheduler and the runner: what to compute this step."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.request import Request


@dataclass(frozen=True)
class PrefillChunk:
    """Prompt tokens [start, start + num_tokens) of one request, to be written to its KV."""

    request: Request
    start: int
    num_tokens: int

    @property
    def token_ids(self) -> tuple[int, ...]:
        return tuple(self.request.prompt_token_ids[self.start : self.start + self.num_tokens])

    @property
    def completes_prefill(self) -> bool:
        return self.start + self.num_tokens == self.request.num_prefill_tokens


@dataclass
class SchedulerOutput:
    prefill_chunks: list[PrefillChunk] = field(default_factory=list)
    # Requests that compute one token this step (their last known token) and sample the next.
    decode_requests: list[Request] = field(default_factory=list)
    # Requests that left since the previous step: their KV is freed now.
    freed_request_ids: list[str] = field(default_factory=list)
    # Requests that finished inside the scheduler (queue timeout); the core reports them.
    expired_requests: list[Request] = field(default_factory=list)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.prefill_chunks)

    @property
    def num_decode_tokens(self) -> int:
        return len(self.decode_requests)

    @property
    def num_scheduled_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def is_empty(self) -> bool:
        return not (self.prefill_chunks or self.decode_requests)
