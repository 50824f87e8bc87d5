"""Image tokens keyed by their image's content for the prefix cache (engine/vision/inputs.py): each run of a kind's
placeholder tokens takes its item's key, every other token keeps its id, and hashing takes the negative keys. A
still image's repeated frames go to the engine once (fold_repeated_frames)."""

from __future__ import annotations

import numpy as np

from engine.kv.cache_manager import PrefixCache, chain_hash
from engine.vision.inputs import VisionInputs, cache_key_ids, fold_repeated_frames, image_digest

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


def test_repeated_frames_fold_to_one_and_anything_else_stays_whole():
    """Qwen2-VL's processor repeats a still image's frame in every patch row ([patches, channels*frames*pixels]):
    sent folded to one frame, the repeat rebuilds the rows bit for bit; rows whose frames differ are not folded."""
    rng = np.random.default_rng(0)
    frame = rng.standard_normal((6, 3, 1, 4)).astype(np.float32)  # 6 patches, 3 channels, 4 pixels a frame
    rows = np.repeat(frame, 2, axis=2).reshape(6, 24)
    folded = fold_repeated_frames(rows, 2, 4)
    assert folded is not None and folded.shape == (6, 3, 4) and folded.nbytes * 2 == rows.nbytes
    assert np.array_equal(np.repeat(folded[:, :, None], 2, axis=2).reshape(6, 24), rows)
    vision = VisionInputs(folded, {}, (A,), pixel_frames=2)
    assert vision.model_pixel_shape() == (6, 24)
    left_out = vision.without_pixels()
    assert left_out.pixel_shape == (6, 24) and left_out.model_pixel_shape() == (6, 24) and left_out.pixel_frames == 1
    moved = rows.copy()
    moved[5, 23] += 1.0  # the last patch's last channel: its second frame differs
    assert fold_repeated_frames(moved, 2, 4) is None
    signed = rows.copy()
    signed[0, 0], signed[0, 4] = 0.0, -0.0  # equal values, other bits: not the same frame
    assert fold_repeated_frames(signed, 2, 4) is None
    assert fold_repeated_frames(rows, 2, 5) is None and fold_repeated_frames(rows, 1, 4) is None
    assert fold_repeated_frames(rows.reshape(6, 3, 8), 2, 4) is None
