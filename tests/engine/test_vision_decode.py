"""A vision-language model's decode rows run through mlx-lm's own text model of the family on the same weights
(engine/vision/text_twin.py), each image row's rope delta folded into the batch's offsets: rows joining and leaving
at different steps, images of different sizes (different deltas) and text rows decode as through mlx-vlm."""

from __future__ import annotations

import pytest

from engine import EngineConfig, EngineCore
from tests.engine.test_vision_engine import FAMILIES, Family
from tests.support.drive import Arrival, run_core
from tests.support.vlm_images import png_bytes


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory) -> Family:
    return Family(FAMILIES[request.param](tmp_path_factory.mktemp(request.param)))


def test_rows_decode_through_the_text_twin_as_through_mlx_vlm(family):
    model = family.loaded.model
    assert model.text_twin is not None

    def arrivals() -> list[Arrival]:
        requests = [family.request("alone-first", [png_bytes(112, 84, seed=1)], max_tokens=9),
                    family.request("small", [png_bytes(56, 56, seed=2)], max_tokens=4),
                    family.request("text", [], max_tokens=7),
                    family.request("large", [png_bytes(140, 112, seed=3)], max_tokens=6)]
        return [Arrival(3 * i, r) for i, r in enumerate(requests)]

    through_twin = run_core(EngineCore(family.loaded, EngineConfig(enable_prefix_cache=False)), arrivals())
    assert model.text_twin is not None  # images seen (the feature check ran) leave it in place
    twin, model.text_twin = model.text_twin, None
    try:
        through_vlm = run_core(EngineCore(family.loaded, EngineConfig(enable_prefix_cache=False)), arrivals())
    finally:
        model.text_twin = twin
    for request_id, expected in through_vlm.items():
        got = through_twin[request_id]
        assert got.token_ids == expected.token_ids, request_id
        assert max(abs(a - b) for a, b in zip(got.logprobs, expected.logprobs)) < 1e-4, request_id


def test_a_text_model_with_another_rotary_layout_is_refused(family):
    from engine.vision.text_twin import _agrees

    model = family.loaded.model
    rotaries = [layer.self_attn.rope for layer in model.text_twin.layers]
    assert _agrees(model, model.text_twin)
    try:
        for rope in rotaries:
            rope.traditional = not rope.traditional
        assert not _agrees(model, model.text_twin)
    finally:
        for rope in rotaries:
            rope.traditional = not rope.traditional

