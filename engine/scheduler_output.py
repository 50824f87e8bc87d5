"""The contract between the scheduler and the runner: what to compute this step, as plain data.

The runner never sees a scheduler `Request`: a request's first schedule sends a `NewRequest` (what the
runner keeps per request), later steps only ids, token slices and the prefix cache's decisions. Live objects
travel by key: a prefix-cache hit as its blocks' hashes (the runner rebuilds the cache from the blocks the prefix
cache holds, locked by the scheduler until the request finishes or is preempted), a structured-output guide as its
spec (resolved in the engine's HeldGuides, held from the request's arrival until it finishes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.errors import OrchardError
from engine.sampling.params import SamplingParams

if TYPE_CHECKING:
    from engine.sampling.guided import GuidedDecoding
    from engine.vision.inputs import VisionInputs


@dataclass(frozen=True)
class NewRequest:
    """A request scheduled for the first time: its cache starts from the prefix-cache blocks of
    `cached_block_hashes` (a hit; kv/cache_manager.py's chain hashes, the blocks' keys in the PrefixCache)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    cached_block_hashes: tuple[int, ...] = ()
    # A multimodal prompt's images, and the keys its KV is cached under (None: the prompt's ids).
    vision: "VisionInputs | None" = None
    prompt_cache_keys: tuple[int, ...] | None = None
    # False: the request asked not to speculate (its rows decode plainly beside speculating ones).
    speculative: bool = True
    # A preempted request taken in again: its prompt_token_ids hold the prompt and the `num_generated` tokens it
    # generated before (recomputed), and its completing chunk samples generated token number num_generated + 1.
    resumed: bool = False
    num_generated: int = 0
    # The adapter bank slot its rows run on (0: the base model).
    adapter_slot: int = 0
    # Its images' features, held since it came without its pixels (Request.held_image_features).
    held_image_features: list | None = None
    # >0: the last cached block is a media tail, reused up to this many of its tokens (kv/cache_manager.py).
    cached_tail_tokens: int = 0

    @property
    def cache_keys(self) -> tuple[int, ...]:
        return self.prompt_token_ids if self.prompt_cache_keys is None else self.prompt_cache_keys

    @property
    def guide_key(self) -> "GuidedDecoding | None":
        """Structured output: the key its compiled guide is held under (sampling/held_guides.py); None: unguided."""
        return self.sampling.guided


@dataclass(frozen=True)
class PrefillChunk:
    """Prompt tokens [start, start + len(token_ids)) of one request, to be written to its KV."""

    request_id: str
    start: int
    token_ids: tuple[int, ...]
    completes_prefill: bool
    # Prefix-cache decisions: copy the completed prompt's uncached blocks, or (snapshot mode) keep a
    # snapshot of the whole cache at this chunk's end, a block boundary.
    cache_prompt: bool = False
    snapshot: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@dataclass(slots=True)  # not frozen: a frozen init costs ~0.9 us against 0.26, made for every row of every step
class DecodeRow:
    """A request that computes its last sampled token and samples the next one; `sample_index` counts its
    samples (0 is the prefill's first token) and keys its seeded noise."""

    request_id: str
    sample_index: int
    # The most draft tokens the row may verify this step (speculative decoding; 0: none): never past max_tokens.
    max_draft_tokens: int = 0


@dataclass(frozen=True)
class ExpiredRequest:
    """A request that ended inside the scheduler (queue timeout) before it ran."""

    request_id: str
    error: OrchardError


@dataclass
class SchedulerOutput:
    new_requests: list[NewRequest] = field(default_factory=list)
    prefill_chunks: list[PrefillChunk] = field(default_factory=list)
    decode_rows: list[DecodeRow] = field(default_factory=list)
    # Requests that left since the previous step: their KV is freed now.
    freed_request_ids: list[str] = field(default_factory=list)
    # Rows leaving the decode batch whose KV goes to the prefix cache: id -> the tokens that KV holds.
    rows_to_cache: dict[str, tuple[int, ...]] = field(default_factory=dict)
    expired: list[ExpiredRequest] = field(default_factory=list)
    # Requests preempted for KV this step: their KV is freed now (a decode row's goes to the prefix cache through
    # rows_to_cache), their sampling state is kept for their resumption.
    preempted_request_ids: list[str] = field(default_factory=list)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.prefill_chunks)
