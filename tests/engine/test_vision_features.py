"""The vision-feature cache: a prompt whose every image was seen before merges the kept tower outputs instead of
running the tower, and answers exactly as without the cache (tokens and logprobs); Qwen2.5-VL keeps its features,
Gemma 3 (whose merge rescales them) keeps none, by the engine's own check."""

from __future__ import annotations

import pytest

from engine import EngineConfig, EngineCore
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
