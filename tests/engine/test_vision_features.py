"""The vision-feature cache: a prompt whose every image was seen before merges the kept tower outputs instead of
running the tower, and answers exactly as without the cache (tokens and logprobs); Qwen2.5-VL keeps its features,
Gemma 3 (whose merge rescales them) keeps none, by the engine's own check. A prompt sent without its pixels (a
repeated image) takes the features kept at its admission and holds them, or is refused so that its pixels come."""

from __future__ import annotations

import pytest

from engine import EngineConfig, EngineCore
from engine.errors import ImagePixelsNeededError
from engine.runner.step_budget import STEP_TARGET_S
from tests.engine.test_batching import assert_same_stream
from tests.engine.test_vision_engine import FAMILIES, Family
from tests.support.drive import Arrival, run_core
from tests.support.vlm_images import png_bytes


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory) -> Family:
    return Family(FAMILIES[request.param](tmp_path_factory.mktemp(request.param)))


def uncached(family: Family, request, **config):
    core = EngineCore(family.loaded, EngineConfig(enable_prefix_cache=False, vision_feature_cache_bytes=0, **config))
    return run_core(core, [Arrival(0, request)])[request.request_id]


def test_a_seen_image_merges_its_kept_features_and_answers_as_without_them(family):
    core = EngineCore(family.loaded, EngineConfig(enable_prefix_cache=False))
    image = png_bytes(112, 84, seed=21)
    run_core(core, [Arrival(0, family.request("first", [image], "t1 t2"))])
    second = run_core(core, [Arrival(0, family.request("second", [image], "t5 t6 t7"))])["second"]
    stats = core.stats().vision_features
    keeps = family.loaded.model.reuses_features
    assert keeps is (family.folder.name.startswith("qwen"))  # Gemma 3's merge divides them by sqrt(hidden) again
    if keeps:
        image_tokens = sum(1 for key in family.request("probe", [image]).prompt_cache_keys if key < 0)
        hidden = family.loaded.model.text_dtype.size * family.loaded.config.get("text_config", family.loaded.config)["hidden_size"]
        assert (stats.misses, stats.hits, stats.entries, stats.bytes) == (1, 1, 1, image_tokens * hidden)
    else:
        assert (stats.hits, stats.entries, stats.bytes) == (0, 0, 0)
    # Only Qwen2.5-VL's batched tower is timed: once, over the first request's one image.
    tower = core.stats().vision_tower
    batched = family.loaded.model.batched_tower is not None
    assert batched is keeps and tower.images == int(batched) and (tower.seconds > 0) is batched
    assert_same_stream(uncached(family, family.request("second", [image], "t5 t6 t7")), second)


def test_two_images_hit_only_when_both_are_kept_in_their_order(family):
    core = EngineCore(family.loaded, EngineConfig(enable_prefix_cache=False))
    a, b, c = (png_bytes(84, 84, seed=s) for s in (31, 32, 33))
    requests = [family.request("ab", [a, b]), family.request("ac", [a, c]), family.request("ca", [c, a]),
                family.request("ba", [b, a])]
    outputs = {r.request_id: run_core(core, [Arrival(0, r)])[r.request_id] for r in requests}
    stats = core.stats().vision_features
    if family.loaded.model.reuses_features:
        # ab: miss (a, b kept); ac: miss (c kept); ca and ba: hits, in the prompt's order
        assert (stats.misses, stats.hits, stats.entries) == (2, 2, 3)
    assert outputs["ca"].logprobs != outputs["ac"].logprobs  # the order reaches the model
    for r in requests:
        assert_same_stream(uncached(family, family.request(r.request_id, *_images(r.request_id, a, b, c))),
                           outputs[r.request_id])


def test_a_budget_of_zero_keeps_nothing_and_a_small_one_keeps_the_latest(family):
    if not family.folder.name.startswith("qwen"):
        pytest.skip("Gemma 3 keeps no features")
    one = EngineCore(family.loaded, EngineConfig(enable_prefix_cache=False, vision_feature_cache_bytes=0))
    images = [png_bytes(84, 84, seed=40 + i) for i in range(3)]
    for i, image in enumerate(images + images[:1]):
        run_core(one, [Arrival(0, family.request(f"r{i}", [image]))])
    assert (one.stats().vision_features.entries, one.stats().vision_features.hits) == (0, 0)
    image_bytes = EngineCore(family.loaded, EngineConfig())  # one image's features, measured
    run_core(image_bytes, [Arrival(0, family.request("m", [images[0]]))])
    size = image_bytes.stats().vision_features.bytes
    two = EngineCore(family.loaded, EngineConfig(enable_prefix_cache=False, vision_feature_cache_bytes=2 * size))
    for i, image in enumerate(images + [images[0], images[2]]):  # 0 was evicted by 2; 2 is still kept
        run_core(two, [Arrival(0, family.request(f"r{i}", [image]))])
    stats = two.stats().vision_features
    assert (stats.misses, stats.hits, stats.entries, stats.bytes) == (4, 1, 2, 2 * size)


def _images(request_id: str, a: bytes, b: bytes, c: bytes) -> tuple[list[bytes]]:
    return ([{"a": a, "b": b, "c": c}[name] for name in request_id],)


def left_out(request):
    """`request` sent without its images' pixels (the serving side's repeated image)."""
    request.vision = request.vision.without_pixels()
    return request


def test_a_prompt_sent_without_its_pixels_merges_held_features_and_answers_as_with_them(family):
    core = EngineCore(family.loaded, EngineConfig(enable_prefix_cache=False))
    image = png_bytes(112, 84, seed=51)
    with pytest.raises(ImagePixelsNeededError) as unseen:  # not kept by this engine: sent again with the pixels
        core.add_request(left_out(family.request("early", [image])))
    run_core(core, [Arrival(0, family.request("first", [image]))])
    if not family.loaded.model.reuses_features:  # Gemma 3 keeps no features: pixels must always go
        with pytest.raises(ImagePixelsNeededError) as refused:
            core.add_request(left_out(family.request("second", [image], "t5 t6 t7")))
        assert refused.value.never_kept
        return
    assert not unseen.value.never_kept
    assert family.loaded.model.merges_without_pixels is True
    second = run_core(core, [Arrival(0, left_out(family.request("second", [image], "t5 t6 t7")))])["second"]
    assert core.stats().vision_features.hits == 1
    assert_same_stream(uncached(family, family.request("second", [image], "t5 t6 t7")), second)


def test_held_features_outlive_their_eviction_by_the_same_step(family):
    """A request taken in without its pixels holds its image's features: another image's tower output, in the
    same step, evicting them from a one-image budget changes nothing."""
    if not family.folder.name.startswith("qwen"):
        pytest.skip("Gemma 3 keeps no features")
    a, b = png_bytes(84, 84, seed=52), png_bytes(84, 84, seed=53)
    measure = EngineCore(family.loaded, EngineConfig())
    run_core(measure, [Arrival(0, family.request("m", [a]))])
    one_image = measure.stats().vision_features.bytes
    core = EngineCore(family.loaded, EngineConfig(enable_prefix_cache=False, vision_feature_cache_bytes=one_image))
    run_core(core, [Arrival(0, family.request("a1", [a]))])
    outputs = run_core(core, [Arrival(0, left_out(family.request("a2", [a], "t5 t6"))),
                              Arrival(0, family.request("b1", [b]))])
    stats = core.stats().vision_features
    assert (stats.entries, stats.bytes) == (1, one_image)  # b's features replaced a's
    assert_same_stream(uncached(family, family.request("a2", [a], "t5 t6")), outputs["a2"])
    with pytest.raises(ImagePixelsNeededError):  # a's are gone now
        core.add_request(left_out(family.request("a3", [a], "t7")))


def test_a_new_image_is_charged_its_measured_tower_time_and_a_kept_or_held_one_nothing(family):
    if not family.folder.name.startswith("qwen"):
        pytest.skip("the batched tower (whose time is measured) is Qwen2.5-VL's")
    core = EngineCore(family.loaded, EngineConfig(enable_prefix_cache=False, prefill_step_tokens=10**6))
    image = png_bytes(112, 84, seed=54)
    run_core(core, [Arrival(0, family.request("first", [image]))])
    per_token = family.loaded.model.tower_s_per_token
    assert per_token is not None and per_token > 0
    new = family.request("new", [png_bytes(112, 84, seed=55)])
    kept, held = family.request("kept", [image]), left_out(family.request("held", [image]))
    for request in (new, kept, held):
        core.add_request(request)
    image_tokens = sum(1 for key in new.cache_keys if key < 0)
    assert new.vision_cost_tokens == int(image_tokens * per_token * 10**6 / STEP_TARGET_S) > 0
    assert kept.vision_cost_tokens == held.vision_cost_tokens == 0
