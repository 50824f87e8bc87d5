"""Orchard's batched forward of Qwen2.5-VL's vision tower (engine/vision/qwen_tower.py): equal to mlx-vlm's own,
on images whose merged grid divides into whole windows (where mlx-vlm's forward attends over empty windows) and on
ones that do not; several images at once equal each alone; a step's new image prompts share one forward."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine import EngineConfig, EngineCore
from engine.request import RequestStatus
from engine.vision.model import TIMED_TOWER_RUNS
from engine.vision.host_merge import HostMerge, same_merge
from engine.vision.qwen_positions import image_rope_delta, mrope_positions, rotary_table, tower_index
from engine.vision.qwen_tower import PROBE_GRIDS, WindowedTower, attention_groups
from tests.engine.test_batching import assert_same_stream
from tests.engine.test_vision_engine import Family
from tests.support.drive import Arrival, collect, run_core
from tests.support.random_vlm import build_random_vlm, vlm_config
from tests.support.tiny_vlms import write_qwen25_vl
from tests.support.vlm_images import png_bytes

# (t, h, w) in patches: merged 8x8 and 4x6 divide into 4x4-unit windows (an empty row and column of windows in
# mlx-vlm's layout), 5x5 and a two-frame 3x4 do not.
GRIDS = [(1, 16, 16), (1, 8, 12), (1, 10, 10), (2, 6, 8)]


def test_attention_groups_batch_segments_by_length_and_drop_empty_ones():
    groups = attention_groups([0, 64, 64, 80, 144, 148, 148])
    runs = [(count, length, run) for _, count, length, run in groups.groups]
    assert runs == [(2, 64, None), (1, 16, 64), (1, 4, 144)]
    gathered = [row for rows, _, _, _ in groups.groups for row in rows.tolist()]
    assert sorted(gathered) == list(range(148)) and gathered != sorted(gathered)
    assert mx.array(gathered)[groups.restore].tolist() == list(range(148))
    in_order = attention_groups([0, 10, 20])  # one group, already in order: one run of rows from 0, no gather
    assert in_order.restore is None and [(count, length, run) for _, count, length, run in in_order.groups] == [(2, 10, 0)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batched_tower_equals_mlx_vlm_and_each_image_alone(dtype):
    model = build_random_vlm(vlm_config("tiny-vl", "bfloat16"), "bfloat16", seed=1, vision_dtype=dtype)
    tower = WindowedTower(model.vision_tower)
    assert WindowedTower.fits(model.vision_tower) and tower.agrees()
    sizes = [t * h * w for t, h, w in GRIDS]
    pixels = mx.random.normal((sum(sizes), 1176), key=mx.random.key(2))
    together = tower(pixels, GRIDS)
    theirs = model.vision_tower(pixels.astype(tower.dtype), mx.array(GRIDS))
    assert together.shape == theirs.shape == (sum(sizes) // 4, 32)
    tolerance = 1e-5 if dtype == "float32" else 1e-2
    assert mx.allclose(together.astype(mx.float32), theirs.astype(mx.float32), rtol=tolerance, atol=tolerance).item()
    bounds = np.cumsum([0, *sizes]).tolist()
    alone = [tower(pixels[a:b], [grid]) for a, b, grid in zip(bounds, bounds[1:], GRIDS)]
    # The same arithmetic; only the matmuls' row blocking differs with the rows in one call.
    alone = mx.concatenate(alone).astype(mx.float32)
    assert mx.allclose(alone, together.astype(mx.float32), rtol=1e-5, atol=1e-5).item()
    # Waited for (computed EVAL_BLOCKS blocks at a time, to bound what MLX holds at once): the same values.
    assert mx.array_equal(tower(pixels, GRIDS, waited=True), together).item()


def test_the_learnt_tower_rate_is_the_median_of_its_timed_runs_not_skewed_by_a_kernel_build(tmp_path):
    """A timed run that built kernels for a new shape (seconds, on a GPU) leaves the rate at the other runs' median:
    a rate it inflated would charge image prompts' prefill budget for far more than their towers take."""
    model = Family(write_qwen25_vl(tmp_path / "qwen")).loaded.model
    for seconds_per_token in (2.0, 1e-4, 3e-4, 2e-4):
        model._note_tower_time(seconds_per_token)
    assert model.tower_s_per_token == pytest.approx(2.5e-4)


@pytest.mark.parametrize("grids", [GRIDS, [(1, 48, 48)], [(1, 50, 36), (3, 4, 4)], [PROBE_GRIDS[0]]])
def test_host_index_arrays_equal_mlx_vlms_own(grids):
    """The window order, window bounds and rotary table from the host (qwen_positions.py) are mlx-vlm's, exactly:
    672x672 (48x48 patches) included."""
    model = build_random_vlm(vlm_config("tiny-vl", "bfloat16"), "bfloat16", seed=1, vision_dtype="float32")
    tower = model.vision_tower
    grid = mx.array([list(g) for g in grids])
    their_index, their_bounds = tower.get_window_index(grid)
    ours = tower_index(grids, tower)
    assert ours.window_index.tolist() == their_index.tolist()
    assert ours.window_bounds == their_bounds.tolist()
    assert mx.array_equal(rotary_table(tower, ours), tower.rot_pos_emb(grid)).item()


@pytest.mark.parametrize("grids", [[(1, 48, 48)], [(1, 16, 64)], [(1, 64, 16)], [(1, 8, 8), (1, 48, 20)],
                                   [(2, 16, 16)], [(1, 2, 2)]])
def test_host_rope_delta_equals_mlx_vlms_position_index(grids):
    """A prompt's M-RoPE delta summed over its grids (image_rope_delta) is mlx-vlm's get_rope_index's: wide, tall,
    two images, two frames, one merged patch; a grid its image runs do not match gives None."""
    model = build_random_vlm(vlm_config("tiny-vl", "bfloat16"), "bfloat16", seed=1, vision_dtype="float32")
    config = model.language_model.config
    image, start, end = config.image_token_id, config.vision_start_token_id, config.vision_end_token_id
    ids = list(range(100, 105))
    for t, h, w in grids:
        ids += [start] + [image] * (t * (h // 2) * (w // 2)) + [end] + list(range(200, 203))
    ids += list(range(300, 307))
    positions, theirs = model.language_model.get_rope_index(mx.array(ids, mx.int32)[None], mx.array(grids), None,
                                                            mx.ones((1, len(ids)), mx.int32))
    assert image_rope_delta(ids, grids, 2, image) == int(theirs.reshape(-1)[0].item())
    assert image_rope_delta(ids, [(1, 4, 4), *grids], 2, image) is None
    # The whole layout from the host (mrope_positions, host_merge.py's): mlx-vlm's positions and delta.
    ours, delta = mrope_positions(ids, grids, 2, image)
    assert ours.tolist() == positions[:, 0].tolist() and delta == int(theirs.reshape(-1)[0].item())
    assert mrope_positions(ids, [(1, 4, 4), *grids], 2, image) is None


@pytest.mark.parametrize("vision_dtype", ["float32", "bfloat16"])
def test_the_host_merge_equals_mlx_vlms_bit_for_bit_and_reads_nothing_back(vision_dtype):
    """Given features, the host's merge (host_merge.py) is mlx-vlm's get_input_embeddings exactly (embeddings in the
    dtype its mx.where promotes to, positions, delta), for text around two images; it checks so once, then builds
    the merge with no device read (mx.array.item and tolist refused meanwhile)."""
    model = build_random_vlm(vlm_config("tiny-vl", "bfloat16"), "bfloat16", seed=1, vision_dtype=vision_dtype)
    config = model.language_model.config
    image, start, end = config.image_token_id, config.vision_start_token_id, config.vision_end_token_id
    grids = [(1, 8, 8), (1, 6, 10)]
    ids = list(range(100, 105))
    for t, h, w in grids:
        ids += [start] + [image] * (t * (h // 2) * (w // 2)) + [end] + list(range(200, 203))
    tokens = mx.array(ids, mx.int32)[None]
    features = mx.random.normal((sum(t * h * w // 4 for t, h, w in grids), 32), key=mx.random.key(3))
    features = features.astype(mx.float32 if vision_dtype == "float32" else mx.bfloat16)

    def theirs():
        return model.get_input_embeddings(tokens, mx.zeros((1, 1176)), mask=mx.ones(tokens.shape, mx.int32),
                                          image_grid_thw=mx.array(grids), cached_image_features=features)
    merge = HostMerge(model)
    assert HostMerge.fits(model)
    first = merge.merged(ids, grids, features, theirs)
    assert merge.agrees is True and same_merge(first, theirs())
    forbidden = pytest.MonkeyPatch()
    forbidden.setattr(mx.array, "item", lambda self: pytest.fail("a device read"))
    forbidden.setattr(mx.array, "tolist", lambda self: pytest.fail("a device read"))
    try:
        again = merge.merged(ids, grids, features, lambda: pytest.fail("mlx-vlm's merge after the check"))
    finally:
        forbidden.undo()
    assert same_merge(again, theirs())


def test_a_forward_that_differs_from_mlx_vlms_is_not_used():
    class Shifted(WindowedTower):
        def __call__(self, pixel_values, grids):
            return super().__call__(pixel_values, grids) + 0.5

    model = build_random_vlm(vlm_config("tiny-vl", "bfloat16"), "bfloat16", seed=1, vision_dtype="float32")
    assert not Shifted(model.vision_tower).agrees()


def test_a_steps_new_image_prompts_share_one_tower_forward_and_answer_as_alone(tmp_path):
    family = Family(write_qwen25_vl(tmp_path / "qwen"))
    model = family.loaded.model
    calls: list[int] = []

    class Counted(WindowedTower):
        def __call__(self, pixel_values, grids, waited=False):
            calls.append(len(grids))
            return super().__call__(pixel_values, grids, waited)

    model.batched_tower = Counted(model.vlm.vision_tower)
    images = [[png_bytes(56, 56, seed=1)], [png_bytes(112, 84, seed=2), png_bytes(84, 84, seed=3)],
              [png_bytes(140, 112, seed=4)]]

    def requests():
        return [family.request(f"r{i}", imgs) for i, imgs in enumerate(images)]

    expected = {}
    for request in requests():
        core = EngineCore(family.loaded, EngineConfig(enable_prefix_cache=False, vision_feature_cache_bytes=0))
        expected.update(run_core(core, [Arrival(0, request)]))
    assert calls == [len(PROBE_GRIDS), 1, 2, 1]  # the check against mlx-vlm's forward at the first image
    calls.clear()
    core = EngineCore(family.loaded, EngineConfig(enable_prefix_cache=False, vision_feature_cache_bytes=0))
    batched = run_core(core, [Arrival(0, r) for r in requests()])
    assert calls == [4]  # three prompts, four images, one forward
    for request_id, stream in expected.items():
        assert_same_stream(stream, batched[request_id])


def test_towers_in_a_prompts_prefill_are_lazy_after_the_timed_runs_and_answer_as_when_waited_for(tmp_path):
    """A burst admitted past max_prefill_seqs has one tower run ahead (waited for and timed, always) and the
    others' in their prompts' prefill: timed while the tower's cost is being learnt (TIMED_TOWER_RUNS), lazy after,
    computed with the prefill. The same tokens and logprobs either way."""
    family = Family(write_qwen25_vl(tmp_path / "qwen"))
    model = family.loaded.model
    images = [png_bytes(56 + 28 * (i % 3), 56, seed=70 + i) for i in range(4)]
    config = EngineConfig(enable_prefix_cache=False, vision_feature_cache_bytes=0, max_prefill_seqs=1,
                          max_decode_seqs=4, prefill_step_tokens=100_000)

    def run_burst():  # four image prompts at once on an idle engine: one run ahead, three in the prefill
        before = model.tower_stats.timed_runs
        core = EngineCore(family.loaded, config)
        results = run_core(core, [Arrival(0, family.request(f"r{i}", [image])) for i, image in enumerate(images)])
        return results, model.tower_stats.timed_runs - before

    waited, timed = run_burst()
    assert timed == 2 and model.tower_stats.images == len(images)
    model.tower_stats.timed_runs = TIMED_TOWER_RUNS  # learnt
    seconds_before = model.tower_stats.seconds
    lazy, timed = run_burst()
    assert timed == 1 and model.tower_stats.images == 2 * len(images)  # the tower run ahead alone
    assert model.tower_stats.seconds > seconds_before
    for request_id, stream in waited.items():
        assert_same_stream(stream, lazy[request_id])


def test_an_image_prompt_arriving_beside_decode_rows_is_admitted_with_its_tower_done(tmp_path):
    """A request with images that arrives while a row decodes has its tower run ahead and waited for at the next
    step, whatever its learnt cost (here an hour), and is admitted in that step beside the decoding row; then it
    answers as it does alone."""
    family = Family(write_qwen25_vl(tmp_path / "qwen"))
    model = family.loaded.model
    image = png_bytes(84, 56, seed=5)
    alone = run_core(EngineCore(family.loaded, EngineConfig(enable_prefix_cache=False)),
                     [Arrival(0, family.request("image", [image]))])["image"]
    model.tower_stats.timed_runs, model.tower_s_per_token = TIMED_TOWER_RUNS, 3600.0  # learnt: slow
    core = EngineCore(family.loaded, EngineConfig(enable_prefix_cache=False))
    core.add_request(core.limits.validate(family.request("text", [], max_tokens=6)))
    results: dict = {}
    for _ in range(2):
        collect(core.step(), results)
    request = core.limits.validate(family.request("image", [image]))
    core.add_request(request)
    timed_before = model.tower_stats.timed_runs
    collect(core.step(), results)
    assert request.held_image_features is not None and request.status == RequestStatus.RUNNING
    assert model.tower_stats.timed_runs == timed_before + 1 and results["text"].finish is None
    while core.has_unfinished_requests():
        collect(core.step(), results)
    assert model.tower_stats.images == 2  # alone's and this one's: none at admission
    assert_same_stream(alone, results["image"])


def test_features_are_held_ahead_for_at_most_max_prefill_seqs_waiting_requests(tmp_path):
    """A queue of image requests behind a full decode batch: towers run ahead for max_prefill_seqs of them (the
    device memory their features hold stays bounded), the others' as the queue moves; each image's tower runs once."""
    family = Family(write_qwen25_vl(tmp_path / "qwen"))
    core = EngineCore(family.loaded, EngineConfig(enable_prefix_cache=False, max_decode_seqs=1, max_prefill_seqs=2))
    core.add_request(core.limits.validate(family.request("text", [], max_tokens=4)))
    results: dict = {}
    collect(core.step(), results)
    requests = [core.limits.validate(family.request(f"image{i}", [png_bytes(56, 56, seed=20 + i)])) for i in range(4)]
    for request in requests:
        core.add_request(request)
    collect(core.step(), results)
    assert [r.held_image_features is not None for r in requests] == [True, True, False, False]
    while core.has_unfinished_requests():
        collect(core.step(), results)
    assert all(results[r.request_id].finish.reason == "length" for r in requests)
    assert family.loaded.model.tower_stats.images == len(requests)


def test_a_batch_of_towers_run_ahead_is_cut_to_the_forward_allowance_at_what_its_runs_held(tmp_path):
    """The tower's waited runs teach what it holds per image token; images run ahead of admission are then taken
    only while they fit the memory the engine leaves its forwards, and answer as when taken together."""
    family = Family(write_qwen25_vl(tmp_path / "qwen"))
    model = family.loaded.model
    config = EngineConfig(enable_prefix_cache=False, vision_feature_cache_bytes=0, max_prefill_seqs=4,
                          prefill_step_tokens=100_000)

    def first_step(allowance_images: int | None, seed: int):
        core = EngineCore(family.loaded, config)
        requests = [core.limits.validate(family.request(f"r{i}", [png_bytes(56, 56, seed=seed + i)]))
                    for i in range(4)]
        if allowance_images is not None:
            per_image = requests[0].num_media_tokens * model.tower_memory.bytes_per_token
            core.forward_allowance_bytes = int(allowance_images * per_image)
        for request in requests:
            core.add_request(request)
        results: dict = {}
        collect(core.step(), results)
        held = sum(1 for request in requests if request.held_image_features is not None)
        while core.has_unfinished_requests():
            collect(core.step(), results)
        return held, results

    held, together = first_step(None, seed=40)
    assert held == 4 and model.tower_memory.bytes_per_token > 0  # learnt from that run
    held, cut = first_step(2.5, seed=40)
    assert held == 2
    for request_id, stream in together.items():
        assert_same_stream(stream, cut[request_id])
