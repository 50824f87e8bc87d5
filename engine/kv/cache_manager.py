"""The prefix cache's scheduler side (plain Python, no MLX): the block index and the KVCacheManager.

Prompt KV is cached in blocks of `block_size` tokens. A block is keyed by a chain hash of its tokens and its
parent's hash, so equal hashes mean equal prefixes; matching also compares each block's tokens and parent link,
so a hash collision can never hand one conversation another's KV. A block in which an image's tokens end and
text follows is also indexed by its tokens through that image: another question on the same image reuses the
block's first positions (a partial block), so the image's KV comes whole from the cache. Blocks hold an opaque
payload (the engine's per-layer arrays) and its size in bytes; unlocked leaf blocks are evicted least-recently-used
whenever the byte budget would be exceeded. In `snapshot_only` mode (models whose caches cannot be cut by position) only the last
block of an inserted chain carries a payload: a snapshot of the whole cache state at that block boundary; a
match ends at the deepest block holding one.

KVCacheManager owns that index's bookkeeping for requests: which cached blocks an admitted request reuses (and
locks until it finishes), where a prefill chunk may end, and which KV the runner should copy into the cache
(completed prompts, rows leaving the decode batch) and when. The runner holds the KV and does the copies
(kv/block_store.py); it never decides them.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from engine.request import Request

ROOT_HASH = 0


def chain_hash(parent_hash: int, tokens: Sequence[int]) -> int:
    digest = hashlib.blake2b(digest_size=16)
    digest.update(parent_hash.to_bytes(16, "little"))
    # struct packs in C (a prefix-cache hit hashes every block twice, on the TTFT path); 8 bytes a key: image
    # tokens are keyed by negative 56-bit ids from their image's digest (engine/vision/inputs.py).
    digest.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return int.from_bytes(digest.digest(), "little")


@dataclass(eq=False)
class CachedBlock:
    block_hash: int
    tokens: tuple[int, ...]
    parent: "CachedBlock | None"
    payload: Any
    nbytes: int
    ref_count: int = 0
    num_children: int = 0

    @property
    def parent_hash(self) -> int:
        return self.parent.block_hash if self.parent is not None else ROOT_HASH

    @property
    def is_evictable(self) -> bool:
        return self.ref_count == 0 and self.num_children == 0


@dataclass
class PrefixCacheStats:
    hits: int = 0
    misses: int = 0
    hit_tokens: int = 0
    evictions: int = 0
    bytes_used: int = 0
    num_blocks: int = 0


def _no_payload(index: int) -> tuple[None, int]:
    return None, 0


def media_end(cache_keys: Sequence[int]) -> int:
    """One past the last media (image or video) token, whose keys are negative; 0: none. Of a prompt, or of a
    block's tokens (how many of them a media tail reuses)."""
    return max((i for i, key in enumerate(cache_keys) if key < 0), default=-1) + 1


# Builds the payload of block i (tokens [i*block_size, (i+1)*block_size)): (payload, nbytes).
PayloadFactory = Callable[[int], tuple[Any, int]]


@dataclass
class PrefixCache:
    block_size: int
    capacity_bytes: int
    snapshot_only: bool = False
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    # In least- to most-recently-used order; a chain is touched leaf first so parents stay behind leaves.
    _blocks: OrderedDict[int, CachedBlock] = field(default_factory=OrderedDict)
    # Blocks where media ends and text follows, by (parent hash, their tokens through the media's last token).
    _media_tails: dict[tuple[int, tuple[int, ...]], CachedBlock] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.capacity_bytes < 0:
            raise ValueError("block_size must be >= 1 and capacity_bytes >= 0")

    # ---- lookup ------------------------------------------------------------
    def match(self, tokens: Sequence[int], max_tokens: int | None = None) -> list[CachedBlock]:
        """Longest chain of cached full blocks that is a prefix of tokens[:max_tokens]; counts a hit or miss."""
        matched = self._chain(tokens, len(tokens) if max_tokens is None else min(max_tokens, len(tokens)))
        if self.snapshot_only:
            while matched and matched[-1].payload is None:
                matched.pop()
        self._touch(matched)
        if matched:
            self.stats.hits += 1
            self.stats.hit_tokens += len(matched) * self.block_size
        else:
            self.stats.misses += 1
        return matched

    def _chain(self, tokens: Sequence[int], limit: int) -> list[CachedBlock]:
        matched: list[CachedBlock] = []
        parent: CachedBlock | None = None
        for start in range(0, limit - self.block_size + 1, self.block_size):
            block_tokens = tuple(tokens[start : start + self.block_size])
            parent_hash = parent.block_hash if parent is not None else ROOT_HASH
            block = self._blocks.get(chain_hash(parent_hash, block_tokens))
            if block is None or block.tokens != block_tokens or block.parent is not parent:
                break
            matched.append(block)
            parent = block
        return matched

    def holds(self, tokens: Sequence[int], end: int) -> bool:
        """Whether cached blocks, or they and a media tail, hold tokens[:end] (plain KV blocks); nothing counted or
        touched: a look ahead of admission, which match() makes."""
        if self.snapshot_only:
            return False
        matched = self._chain(tokens, end)
        start = len(matched) * self.block_size
        if start >= end:
            return True
        window = tuple(tokens[start : start + self.block_size])
        parent_hash = matched[-1].block_hash if matched else ROOT_HASH
        return start + media_end(window) >= end and (parent_hash, window[: end - start]) in self._media_tails

    def match_media_tail(self, tokens: Sequence[int], matched: list[CachedBlock],
                         max_tokens: int | None = None) -> tuple[CachedBlock, int] | None:
        """After match()'s chain: a cached block that begins with the prompt's next tokens through its last media
        token, where those end inside the block (another question on a cached image); with how many of its tokens
        the prompt reuses. Counted with match()'s hit or miss."""
        if self.snapshot_only:
            return None
        start = len(matched) * self.block_size
        limit = len(tokens) if max_tokens is None else min(max_tokens, len(tokens))
        window = tuple(tokens[start : min(start + self.block_size, limit)])
        length = media_end(window)
        if not 0 < length < self.block_size:
            return None
        parent = matched[-1] if matched else None
        block = self._media_tails.get((parent.block_hash if parent is not None else ROOT_HASH, window[:length]))
        if block is None or block.tokens[:length] != window[:length] or block.parent is not parent:
            return None
        self._touch([*matched, block])
        if not matched:  # match() counted a miss
            self.stats.misses -= 1
            self.stats.hits += 1
        self.stats.hit_tokens += length
        return block, length

    def block(self, block_hash: int) -> CachedBlock:
        """The cached block of this hash (a locked block stays until its request unlocks it)."""
        return self._blocks[block_hash]

    def lock(self, blocks: Sequence[CachedBlock]) -> None:
        for block in blocks:
            block.ref_count += 1

    def unlock(self, blocks: Sequence[CachedBlock]) -> None:
        for block in blocks:
            if block.ref_count <= 0:
                raise ValueError("unlock of a block that is not locked")
            block.ref_count -= 1

    # ---- insertion and eviction -------------------------------------------
    def insert(self, tokens: Sequence[int], make_payload: PayloadFactory) -> list[CachedBlock]:
        """Cache every full block of `tokens` not cached yet; returns the chain actually cached.

        Stops early (never exceeding the budget) when a block cannot be made room for.
        """
        chain: list[CachedBlock] = []
        parent: CachedBlock | None = None
        num_blocks = len(tokens) // self.block_size
        for index in range(num_blocks):
            with_payload = not self.snapshot_only or index == num_blocks - 1
            block_tokens = tuple(tokens[index * self.block_size : (index + 1) * self.block_size])
            block_hash = chain_hash(parent.block_hash if parent else ROOT_HASH, block_tokens)
            block = self._blocks.get(block_hash)
            if block is not None and (block.tokens != block_tokens or block.parent is not parent):
                break  # a hash collision: keep what is cached, add nothing below it
            if block is None:
                factory = make_payload if with_payload else _no_payload
                block = self._add_block(block_hash, block_tokens, parent, factory, index, protect=chain)
                if block is None:
                    break
            elif with_payload and block.payload is None and not self._attach_payload(block, make_payload, index, chain):
                break
            chain.append(block)
            parent = block
        self._touch(chain)
        return chain

    def _add_block(self, block_hash, block_tokens, parent, make_payload, index, protect) -> CachedBlock | None:
        payload, nbytes = make_payload(index)
        # The chain being built must survive the eviction that makes room for its next block.
        self.lock(protect)
        try:
            if not self._make_room(nbytes):
                return None
        finally:
            self.unlock(protect)
        block = CachedBlock(block_hash, block_tokens, parent, payload, nbytes)
        self._blocks[block_hash] = block
        tail = media_end(block_tokens)
        if 0 < tail < self.block_size and not self.snapshot_only:
            self._media_tails[(block.parent_hash, block_tokens[:tail])] = block  # the newest such block
        if parent is not None:
            parent.num_children += 1
        self.stats.bytes_used += nbytes
        self.stats.num_blocks += 1
        return block

    def _attach_payload(self, block: CachedBlock, make_payload: PayloadFactory, index: int, chain) -> bool:
        """Give a payload-less (snapshot-mode) block its snapshot, within the budget."""
        payload, nbytes = make_payload(index)
        self.lock([*chain, block])
        try:
            if not self._make_room(nbytes):
                return False
        finally:
            self.unlock([*chain, block])
        block.payload, block.nbytes = payload, nbytes
        self.stats.bytes_used += nbytes
        return True

    def _make_room(self, nbytes: int) -> bool:
        if nbytes > self.capacity_bytes:
            return False
        while self.stats.bytes_used + nbytes > self.capacity_bytes:
            if not self._evict_one():
                return False
        return True

    def _evict_one(self) -> bool:
        victim = next((b for b in self._blocks.values() if b.is_evictable), None)
        if victim is None:
            return False
        self._remove(victim)
        self.stats.evictions += 1
        # Payload-less parents left without children hold nothing worth keeping.
        parent = victim.parent
        while parent is not None and parent.payload is None and parent.is_evictable:
            self._remove(parent)
            parent = parent.parent
        return True

    def _remove(self, block: CachedBlock) -> None:
        del self._blocks[block.block_hash]
        tail = (block.parent_hash, block.tokens[:media_end(block.tokens)])
        if self._media_tails.get(tail) is block:
            del self._media_tails[tail]
        if block.parent is not None:
            block.parent.num_children -= 1
        self.stats.bytes_used -= block.nbytes
        self.stats.num_blocks -= 1

    def evict_all_unlocked(self) -> None:
        while self._evict_one():
            pass

    def _touch(self, blocks: Sequence[CachedBlock]) -> None:
        for block in reversed(blocks):
            self._blocks.move_to_end(block.block_hash)

    # ---- invariants ---------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise AssertionError if any bookkeeping invariant is broken."""
        children: dict[int, int] = {h: 0 for h in self._blocks}
        for block_hash, block in self._blocks.items():
            assert block.block_hash == block_hash == chain_hash(block.parent_hash, block.tokens)
            assert len(block.tokens) == self.block_size and block.ref_count >= 0 and block.nbytes >= 0
            if block.parent is not None:
                assert self._blocks.get(block.parent.block_hash) is block.parent, "orphaned block"
                children[block.parent.block_hash] += 1
        assert all(self._blocks[h].num_children == n for h, n in children.items())
        assert self.stats.bytes_used == sum(b.nbytes for b in self._blocks.values())
        assert self.stats.bytes_used <= self.capacity_bytes
        assert self.stats.num_blocks == len(self._blocks)
        assert all(self._blocks.get(b.block_hash) is b for b in self._media_tails.values())


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
        keys, limit = request.prefill_cache_keys(), request.num_prefill_tokens - 1
        blocks = cache.match(keys, max_tokens=limit)
        tail = cache.match_media_tail(keys, blocks, max_tokens=limit) if request.vision is not None else None
        request.num_computed_tokens = len(blocks) * cache.block_size
        request.prefix_tail_tokens = 0
        if tail is not None:
            blocks = [*blocks, tail[0]]
            request.prefix_tail_tokens = tail[1]
            request.num_computed_tokens += tail[1]
        cache.lock(blocks)
        request.prefix_blocks = blocks
        if not request.num_preemptions:  # usage reports the prompt's hit at its first admission
            request.num_cached_tokens = request.num_computed_tokens

    def first_block(self, request: Request) -> tuple[int, ...] | None:
        """The prompt's first block of cache keys, None without block caching: prompts sharing it hit each other's
        KV once one of them is cached."""
        if not self.cuts_blocks:
            return None
        return request.cache_keys[: self.prefix_cache.block_size]

    def holds_media(self, request: Request) -> bool:
        """Whether the prefix cache holds the prompt's KV through its last image or video token (then its media
        need no vision tower), as reuse_cached_prefix would find it now."""
        keys = request.prefill_cache_keys()
        end = media_end(keys)
        return self.prefix_cache is not None and 0 < end < request.num_prefill_tokens and self.prefix_cache.holds(keys, end)

    def release(self, request: Request) -> None:
        if self.prefix_cache is not None and request.prefix_blocks:
            self.prefix_cache.unlock(request.prefix_blocks)
            request.prefix_blocks = []
            request.prefix_tail_tokens = 0

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
        full_blocks = len(request.prefix_blocks) - (1 if request.prefix_tail_tokens else 0)
        if full_blocks >= request.num_prefill_tokens // size:
            return False
        self._uncached_first_blocks.add(self.first_block(request))
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
        return bool(firsts) and any(self.first_block(r) in firsts for r in waiting if not r.num_computed_tokens)

    def begin_step(self) -> None:
        """The last step's completed prompts are cached from now on (before or during this step)."""
        self._uncached_first_blocks = set()

    def tokens_to_cache(self, request: Request) -> tuple[int, ...] | None:
        """For a row leaving the decode batch: the tokens its KV holds (prompt and generated), if cached."""
        if not self.cuts_blocks:
            return None
        return tuple(request.all_cache_keys()[: request.num_computed_tokens])
