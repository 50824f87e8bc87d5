"""KVCacheManager: the scheduler's side of the prefix cache (plain Python, no MLX).

It owns the prefix-cache index's bookkeeping for requests: which cached blocks an admitted request
reuses (and locks until it finishes), where a prefill chunk may end, and which KV the runner should copy
into the cache (completed prompts, rows leaving the decode batch) and when. The runner holds the KV and
does the copies (kv/block_store.py); it never decides them.
"""

from __future__ import annotations

from typing import Iterable

from engine.kv.prefix_cache import PrefixCache
from engine.request import Request


class KVCacheManager:
    def __init__(self, prefix_cache: PrefixCache | None = None) -> None:
        self.prefix_cache = prefix_cache
        # First blocks of the prompts the last step completed: the runner copies those prompts into the
        # cache during the next step, after its new prompts reach the device, unless one may be hit first.
        self._uncached_first_blocks: set[tuple[int, ...]] = set()

    @property
    def cuts_blocks(self) -> bool:
        """KV is cut into blocks by position (plain KV caches); False: whole-cache snapshots, or no cache."""
        return self.prefix_cache is not None and not self.prefix_cache.snapshot_only

    # ---- admission and release -----------------------------------------------
    def reuse_cached_prefix(self, request: Request) -> None:
        """Lock the prompt's longest cached block prefix and skip it (never the last prompt token: its
        logits give the first output token)."""
        cache = self.prefix_cache
        if cache is None or request.num_computed_tokens:
            return
        blocks = cache.match(request.prompt_token_ids, max_tokens=request.num_prefill_tokens - 1)
        cache.lock(blocks)
        request.prefix_blocks = blocks
        request.num_cached_tokens = request.num_computed_tokens = len(blocks) * cache.block_size

    def release(self, request: Request) -> None:
        if self.prefix_cache is not None and request.prefix_blocks:
            self.prefix_cache.unlock(request.prefix_blocks)
            request.prefix_blocks = []

    # ---- chunking --------------------------------------------------------------
    def prefill_target(self, request: Request) -> int:
        """Where the request's next chunk may end: its prefill end, or first the last block boundary
        before it when the cache keeps whole-cache snapshots there."""
        end = request.num_prefill_tokens
        if self.prefix_cache is None or not self.prefix_cache.snapshot_only:
            return end
        boundary = end - end % self.prefix_cache.block_size
        return boundary if request.num_computed_tokens < boundary else end

    def should_cache_prompt(self, request: Request) -> bool:
        """For a chunk completing the prompt: whether the prompt holds full blocks beyond those it was
        served from (a full hit has none). Noted as uncached until the next step copies it."""
        if not self.cuts_blocks:
            return False
        size = self.prefix_cache.block_size
        if len(request.prefix_blocks) >= request.num_prompt_tokens // size:
            return False
        self._uncached_first_blocks.add(tuple(request.prompt_token_ids[:size]))
        return True

    def should_snapshot(self, request: Request, chunk_end: int) -> bool:
        """Snapshot mode: a chunk ending on a block boundary beyond the cached prefix leaves a snapshot."""
        cache = self.prefix_cache
        if cache is None or not cache.snapshot_only:
            return False
        return chunk_end % cache.block_size == 0 and chunk_end > len(request.prefix_blocks) * cache.block_size

    # ---- copies the runner makes -------------------------------------------------
    def uncached_prompts_may_be_hit(self, waiting: Iterable[Request]) -> bool:
        """Whether a waiting request shares a first block with the prompts the last step completed: then
        they are copied before this step admits anyone (~15 ms of CPU for 32 prompts of 517 tokens on an
        H100, which new prompts' first tokens would otherwise not wait for)."""
        firsts = self._uncached_first_blocks
        if not firsts:
            return False
        size = self.prefix_cache.block_size
        return any(tuple(r.prompt_token_ids[:size]) in firsts for r in waiting if not r.num_computed_tokens)

    def begin_step(self) -> None:
        """The last step's completed prompts are cached from now on (before or during this step)."""
        self._uncached_first_blocks = set()

    def tokens_to_cache(self, request: Request) -> tuple[int, ...] | None:
        """For a row leaving the decode batch: the tokens its KV holds (prompt and generated), if cached."""
        if not self.cuts_blocks:
            return None
        return tuple(request.all_token_ids()[: request.num_computed_tokens])
