"""Per-request state shared by the scheduler and the engine core (its checks against the model's limits are in
request_limits.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum, IntEnum
from typing import TYPE_CHECKING, Sequence

from engine.errors import OrchardError
from engine.sampling.params import SamplingParams

if TYPE_CHECKING:
    from engine.sampling.structured import CompiledGuide
    from engine.vision.inputs import VisionInputs


class RequestStatus(IntEnum):
    """Ordered: every status after PREEMPTED is a finished one."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED


class Priority(IntEnum):
    """Scheduling classes, the lower first: interactive requests are admitted ahead of batch ones (OpenAI's Batches
    API lines), and a batch row gives its slot or its KV up to an interactive one (preempted, resumed later)."""

    INTERACTIVE = 0
    BATCH = 1


class FinishReason(str, Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


FINISH_REASON_OF_STATUS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


@dataclass(eq=False)
class Request:
    """One generation request.

    The whole prompt is prefilled; the chunk that completes it also samples the first
    token from its last position (no extra step before the first token). Every later
    token comes from a decode step that feeds the previous one.
    """

    request_id: str
    prompt_token_ids: Sequence[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    # KV entries computed (or scheduled to be) for this request.
    num_computed_tokens: int = 0
    # Tokens whose sampling is dispatched (the prefill's first token counts as one);
    # reaches max_tokens before the last token is read back.
    num_decode_steps: int = 0
    num_cached_tokens: int = 0
    # Prefix-cache blocks this request reuses; locked from admission until it finishes.
    prefix_blocks: list = field(default_factory=list)  # kv.cache_manager.CachedBlock (the kv layer sits above)
    # >0: the last of them is a media tail, of which only these first tokens are reused (cache_manager.py).
    prefix_tail_tokens: int = 0
    stop_reason: str | int | None = None
    error: OrchardError | None = None
    # Structured output: the compiled automaton for sampling.guided, set before scheduling.
    guide: "CompiledGuide | None" = None
    # A multimodal prompt's images, and the prompt as the prefix cache keys it (image tokens keyed by their
    # image's content: engine/vision/inputs.py); None for a text prompt, keyed by its token ids.
    vision: "VisionInputs | None" = None
    prompt_cache_keys: Sequence[int] | None = None
    # Its images' features: taken from the engine's kept ones when it came without its pixels, or made by its tower
    # run ahead of its admission (EngineCore); its prefill merges them, running no tower.
    held_image_features: list | None = None
    # Its vision tower's time as the prompt tokens the device prefills meanwhile: charged to the step budget of its
    # first chunk after each admission (unpaid until then).
    vision_cost_tokens: int = 0
    unpaid_vision_tokens: int = 0
    # False: never speculate for this request (it decodes plainly, in the same batch).
    speculative: bool = True
    # A per-request LoRA adapter, by its name on this model (None: the base model), and the bank slot the engine
    # runs it on (set when the engine takes the request; 0: none).
    adapter: str | None = None
    adapter_slot: int = 0
    priority: Priority = Priority.INTERACTIVE
    # Draft tokens verified for this request, and how many of them it accepted (usage reports both).
    num_drafted_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    # Preemption (KV budget): times this request was preempted, and the generated tokens its resumed prefill
    # recomputes after the prompt (its KV is rebuilt from prompt + those tokens).
    num_preemptions: int = 0
    num_recomputed_outputs: int = 0
    _output_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.prompt_token_ids = tuple(self.prompt_token_ids)
        if self.prompt_cache_keys is not None:
            self.prompt_cache_keys = tuple(self.prompt_cache_keys)
            if len(self.prompt_cache_keys) != len(self.prompt_token_ids):
                raise ValueError("prompt_cache_keys must key every prompt token")

    @property
    def cache_keys(self) -> tuple[int, ...]:
        """The prompt as the prefix cache sees it."""
        return self.prompt_token_ids if self.prompt_cache_keys is None else self.prompt_cache_keys  # type: ignore[return-value]

    @property
    def num_media_tokens(self) -> int:
        """The prompt's image and video tokens (the prefix cache keys them by their media, negative)."""
        return sum(1 for key in self.cache_keys if key < 0)

    @property
    def max_tokens(self) -> int:
        if self.sampling.max_tokens is None:
            raise ValueError("max_tokens must be resolved before the request is scheduled")
        return self.sampling.max_tokens

    @property
    def output_token_ids(self) -> Sequence[int]:
        return tuple(self._output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_recomputed_outputs

    def prefill_token_ids(self) -> tuple[int, ...]:
        """What the prefill computes: the prompt, and after a preemption the tokens generated before it."""
        if not self.num_recomputed_outputs:
            return self.prompt_token_ids  # type: ignore[return-value]
        return (*self.prompt_token_ids, *self._output_token_ids[: self.num_recomputed_outputs])

    def prefill_cache_keys(self) -> tuple[int, ...]:
        """The prefill's tokens as the prefix cache keys them."""
        if not self.num_recomputed_outputs:
            return self.cache_keys
        return (*self.cache_keys, *self._output_token_ids[: self.num_recomputed_outputs])

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.num_prefill_tokens

    @property
    def wants_more_decode_steps(self) -> bool:
        return self.num_decode_steps < self.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return FINISH_REASON_OF_STATUS.get(self.status)

    def as_submitted(self) -> "Request":
        """A new request of this one's inputs (prompt, sampling, images, cache keys, speculation opt-out, compiled
        guide, adapter, priority) and none of its progress: what a replacement engine runs again."""
        return Request(
            self.request_id, self.prompt_token_ids, self.sampling, arrival_time=self.arrival_time, guide=self.guide,
            vision=self.vision, prompt_cache_keys=self.prompt_cache_keys, speculative=self.speculative,
            adapter=self.adapter, priority=self.priority,
        )

    def append_output_token(self, token_id: int) -> None:
        self._output_token_ids.append(token_id)

    def all_cache_keys(self) -> list[int]:
        return [*self.cache_keys, *self._output_token_ids]


# A prompt's first key under an adapter: above every token id (< 2**32) and image key (negative), one value per
# (adapter load, first token), so each adapter load's KV chains apart from the base model's and other adapters'.
ADAPTER_KEY_BIT = 1 << 62


def adapter_cache_keys(keys: Sequence[int], first_token: int, adapter_uid: int) -> tuple[int, ...]:
    """`keys` with the first replaced by the adapter's (blocks chain from their first: every block differs)."""
    if not (0 <= first_token < 1 << 32 and 0 < adapter_uid < 1 << 29):
        raise ValueError("an adapter's cache keys need a token id below 2**32 and a uid below 2**29")
    return (ADAPTER_KEY_BIT | adapter_uid << 32 | first_token, *keys[1:])
