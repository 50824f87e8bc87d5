"""Image tokens keyed by their image's content for the prefix cache (engine/vision/inputs.py): each run of a kind's
placeholder tokens takes its item's key, every other token keeps its id, and hashing takes the negative keys."""

from __future__ import annotations

from engine.kv.cache_manager import PrefixCache, chain_hash
from engine.vision.inputs import cache_key_ids, image_digest

IMAGE, VIDEO = 900, 901
A, B, V = image_digest("RGB", (2, 2), b"a" * 12), image_digest("RGB", (2, 2), b"b" * 12), "f" * 64


def test_each_run_of_image_tokens_takes_its_images_key():
    ids = [1, IMAGE, IMAGE, 2, IMAGE, IMAGE, IMAGE, 3]
    keys = cache_key_ids(ids, [(IMAGE, (A, B))])
    assert keys[0] == 1 and keys[3] == 2 and keys[7] == 3
    assert keys[1] == keys[2] < 0 and keys[4] == keys[5] == keys[6] < 0 and keys[1] != keys[4]
    assert cache_key_ids(ids, [(IMAGE, (B, A))])[1] == keys[4]  # the key follows the image, not its place
    assert cache_key_ids([1, 2, 3], [(IMAGE, (A,))]) == (1, 2, 3)


def test_runs_and_images_that_do_not_pair_up_are_keyed_by_all_the_images():
    tiled = [IMAGE, IMAGE, 5, IMAGE, IMAGE, 6, IMAGE]  # three runs for two images (a processor's tiles)
    keys = cache_key_ids(tiled, [(IMAGE, (A, B))])
    assert {keys[i] for i in (0, 1, 3, 4, 6)} == {keys[0]} and keys[0] < 0
    assert cache_key_ids(tiled, [(IMAGE, (A, A))])[0] != keys[0] != cache_key_ids(tiled, [(IMAGE, (B, A))])[0]


def test_videos_are_keyed_apart_from_images():
    ids = [IMAGE, IMAGE, 7, VIDEO, VIDEO, VIDEO]
    keys = cache_key_ids(ids, [(IMAGE, (A,)), (VIDEO, (V,))])
    assert keys[0] == keys[1] != keys[3] == keys[4] == keys[5] and keys[2] == 7


def test_the_same_digest_of_other_pixels_differs_and_negative_keys_hash():
    assert image_digest("RGB", (2, 2), b"a" * 12) != image_digest("RGB", (3, 1), b"a" * 12)
    keys = cache_key_ids([1, IMAGE, IMAGE, 2], [(IMAGE, (A,))])
    other = cache_key_ids([1, IMAGE, IMAGE, 2], [(IMAGE, (B,))])
    assert chain_hash(0, keys) != chain_hash(0, other)
    cache = PrefixCache(2, capacity_bytes=1000)
    cache.insert(keys, lambda index: (index, 10))
    assert len(cache.match(keys)) == 2 and len(cache.match(other)) == 0  # [1, image] differs from the first block
