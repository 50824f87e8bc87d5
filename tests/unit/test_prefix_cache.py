"""Prefix cache bookkeeping without MLX: match / lock / insert / evict, budget, integrity."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kv.cache_manager import PrefixCache

BLOCK = 4


def payload(tokens, nbytes=10):
    """A factory whose payload records which tokens it stands for (to catch cross-talk)."""
    return lambda i: (tuple(tokens[i * BLOCK : (i + 1) * BLOCK]), nbytes)


def test_match_returns_the_longest_cached_block_prefix():
    cache = PrefixCache(BLOCK, capacity_bytes=1000)
    prompt = list(range(10))  # two full blocks + 2 tokens
    assert cache.match(prompt) == []
    inserted = cache.insert(prompt, payload(prompt))
    assert [b.tokens for b in inserted] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert cache.match(prompt + [99]) == inserted
    assert cache.match(list(range(6)) + [50, 51]) == inserted[:1]
    assert cache.match([0, 1, 2, 9]) == []
    assert cache.match(prompt, max_tokens=7) == inserted[:1]
    assert (cache.stats.hits, cache.stats.misses, cache.stats.hit_tokens) == (3, 2, 16)
    cache.check_integrity()


def test_holds_looks_through_blocks_and_a_media_tail_counting_and_touching_nothing():
    cache = PrefixCache(BLOCK, capacity_bytes=1000)
    image = [-7] * 5
    first = [1, 2, *image, 10, 11, 12, 13, 14]  # the image ends inside the second block
    cache.insert(first, payload(first))
    order = list(cache._blocks)
    second = [1, 2, *image, 20, 21]
    assert cache.holds(second, 7) and cache.holds(second, 4) and cache.holds(first, 12)
    assert not cache.holds([1, 2, -8, -8, -8, -8, -8, 20], 7)  # another image
    assert not cache.holds(second + [30] * 8, 16)  # past what is cached
    assert (cache.stats.hits, cache.stats.misses, cache.stats.hit_tokens) == (0, 0, 0) and list(cache._blocks) == order


def test_another_question_on_a_cached_image_reuses_the_block_it_ends_in_through_its_last_token():
    cache = PrefixCache(BLOCK, capacity_bytes=50)
    image = [-7] * 5  # an image's tokens (negative keys), ending inside the second block
    first = [1, 2, *image, 10, 11, 12, 13, 14]
    chain = cache.insert(first, payload(first))
    second = [1, 2, *image, 20, 21, 22, 23, 24]
    matched = cache.match(second)
    assert matched == chain[:1]
    assert cache.match_media_tail(second, matched) == (chain[1], 3)  # (-7, -7, -7) of (-7, -7, -7, 10)
    assert (cache.stats.hits, cache.stats.misses, cache.stats.hit_tokens) == (1, 0, 4 + 3)
    # Another image, another parent, or the image cut by max_tokens: no tail.
    assert cache.match_media_tail([1, 2, -8, -8, -8, -8, -8, 20], matched) is None
    assert cache.match_media_tail([0, 2, *image, 20], []) is None
    assert cache.match_media_tail(second, matched, max_tokens=6) is None
    # A text block and a block that ends with the image are no tails.
    assert cache.match_media_tail([1, 2, 3, 4, 5, 6, 7, 8], cache.match([1, 2, 3, 4])) is None
    ends = [*image[:2], 1, 2, *image[:4]]
    cache.insert(ends, payload(ends))
    assert cache.match_media_tail(ends + [5], cache.match(ends[:4])) is None  # a whole block: match() has it
    cache.check_integrity()
    # The tail's block evicted (the budget holds 5 blocks of 10 bytes): its index entry goes with it.
    for n in range(4):
        other = [100 + n] * 8
        cache.insert(other, payload(other))
    assert cache.match_media_tail(second, cache.match(second)) is None
    cache.check_integrity()


def test_diverging_conversations_share_only_their_common_blocks():
    cache = PrefixCache(BLOCK, capacity_bytes=1000)
    a = [1, 2, 3, 4, 5, 6, 7, 8]
    b = [1, 2, 3, 4, 9, 9, 9, 9]
    chain_a, chain_b = cache.insert(a, payload(a)), cache.insert(b, payload(b))
    assert chain_a[0] is chain_b[0] and chain_a[1] is not chain_b[1]
    assert [blk.payload for blk in cache.match(b)] == [(1, 2, 3, 4), (9, 9, 9, 9)]
    # Same second-block tokens after a different first block: a different block.
    c = [0, 0, 0, 0, 5, 6, 7, 8]
    assert cache.match(c) == []
    cache.check_integrity()


def test_locked_blocks_are_never_evicted_and_budget_holds():
    cache = PrefixCache(BLOCK, capacity_bytes=30)
    first = list(range(8))
    chain = cache.insert(first, payload(first))
    cache.lock(chain)
    second = list(range(100, 108))
    assert len(cache.insert(second, payload(second))) == 1  # room for one block only
    assert cache.stats.bytes_used == 30 and cache.stats.evictions == 0
    cache.unlock(chain)
    third = list(range(200, 208))
    assert len(cache.insert(third, payload(third))) == 2
    assert cache.stats.bytes_used <= 30 and cache.stats.evictions >= 1
    with pytest.raises(ValueError):
        cache.unlock(chain)
    cache.check_integrity()


def test_least_recently_used_leaf_goes_first_and_parents_outlive_children():
    cache = PrefixCache(BLOCK, capacity_bytes=40)
    old, new = list(range(8)), list(range(50, 58))
    old_chain = cache.insert(old, payload(old))
    cache.insert(new, payload(new))
    cache.match(new)
    extra = list(range(90, 94))
    cache.insert(extra, payload(extra))  # needs one block of room: the old leaf goes
    assert cache.match(old) == old_chain[:1]
    cache.check_integrity()


def test_a_block_larger_than_the_budget_is_not_cached():
    cache = PrefixCache(BLOCK, capacity_bytes=5)
    assert cache.insert([1, 2, 3, 4], payload([1, 2, 3, 4], nbytes=6)) == []
    assert cache.stats.bytes_used == 0
    cache.check_integrity()


operations = st.lists(
    st.tuples(
        st.sampled_from(["insert", "match_lock", "unlock", "evict"]),
        st.lists(st.integers(0, 3), min_size=0, max_size=14),
        st.integers(1, 30),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(operations, st.integers(0, 120), st.booleans())
def test_random_operation_sequences_keep_every_invariant(ops, capacity, snapshot_only):
    cache = PrefixCache(BLOCK, capacity_bytes=capacity, snapshot_only=snapshot_only)
    held = []
    for op, tokens, nbytes in ops:
        if op == "insert":
            cache.insert(tokens, payload(tokens, nbytes))
        elif op == "match_lock":
            blocks = cache.match(tokens)
            cache.lock(blocks)
            held.append(blocks)
            for i, block in enumerate(blocks):  # a hit always stands for exactly these tokens
                if not snapshot_only or i == len(blocks) - 1:
                    assert block.payload == tuple(tokens[i * BLOCK : (i + 1) * BLOCK])
        elif op == "unlock" and held:
            cache.unlock(held.pop(0))
        elif op == "evict":
            cache.evict_all_unlocked()
            assert all(b.ref_count > 0 or b.num_children > 0 for b in cache._blocks.values())
        cache.check_integrity()
    for blocks in held:
        cache.unlock(blocks)
    cache.evict_all_unlocked()
    assert cache.stats.bytes_used == 0 and cache.stats.num_blocks == 0


def test_snapshot_mode_matches_only_up_to_the_deepest_snapshot():
    cache = PrefixCache(BLOCK, capacity_bytes=1000, snapshot_only=True)
    short = list(range(8))
    long = list(range(16))
    first = cache.insert(short, payload(short))
    assert [b.payload for b in first] == [None, (4, 5, 6, 7)]
    assert cache.match(long) == first  # blocks 3-4 are not cached yet
    second = cache.insert(long, payload(long))
    assert [b.payload for b in second] == [None, (4, 5, 6, 7), None, (12, 13, 14, 15)]
    assert cache.match(long[:12] + [0, 0, 0, 0]) == first  # block 3 exists but holds no snapshot
    cache.check_integrity()
    cache.evict_all_unlocked()
    assert cache.stats.num_blocks == 0 and cache.stats.bytes_used == 0
