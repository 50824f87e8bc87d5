"""mflux's FLUX.2 [klein] as Orchard runs it (engine/images/generator.py), on a tiny random model: the same seed
makes the same image, every step is reported, a step callback that raises stops the generation there."""

from __future__ import annotations

import io

import pytest

from engine.images.families import FAMILIES
from engine.images.generator import ImageGenerator, ImageSpec, model_config
from tests.support.tiny_images import TRANSFORMER


class Stop(Exception):
    pass


@pytest.fixture(scope="module")
def generator(tiny_klein) -> ImageGenerator:
    return ImageGenerator(tiny_klein, FAMILIES["flux2-klein-4b"])


def png(image) -> bytes:
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def test_the_folders_dimensions_replace_the_registrys(tiny_klein):
    config = model_config(FAMILIES["flux2-klein-4b"], tiny_klein)
    assert config.transformer_overrides["num_layers"] == TRANSFORMER["num_layers"] == 1
    assert config.transformer_overrides["axes_dims_rope"] == (8, 8, 8, 8)
    assert config.text_encoder_overrides["hidden_size"] == 64
    from mflux.models.common.config.model_config import AVAILABLE_MODELS

    assert AVAILABLE_MODELS["flux2-klein-4b"].transformer_overrides["num_layers"] == 5  # the registry's is untouched


def test_the_same_seed_makes_the_same_image_and_every_step_is_reported(generator):
    steps: list[tuple[int, int]] = []
    spec = ImageSpec("a puffin on a cliff", 64, 48, 2, 1.0, seed=7)
    first = generator.generate(spec, lambda done, total: steps.append((done, total)))
    assert first.size == (64, 48)
    assert steps == [(1, 2), (2, 2)]
    assert png(generator.generate(spec)) == png(first)
    other = generator.generate(ImageSpec("a puffin on a cliff", 64, 48, 2, 1.0, seed=8))
    assert png(other) != png(first)


def test_a_step_callback_that_raises_stops_the_generation_there(generator):
    seen: list[int] = []

    def stop_after_one(done: int, total: int) -> None:
        seen.append(done)
        raise Stop()

    with pytest.raises(Stop):
        generator.generate(ImageSpec("a red dragon", 64, 64, 3, 1.0, seed=1), stop_after_one)
    assert seen == [1]
    assert generator.generate(ImageSpec("a red dragon", 64, 64, 1, 1.0, seed=1)).size == (64, 64)  # serves on


def test_the_editor_makes_an_image_of_the_asked_size_from_an_input_image(tiny_klein, generator):
    editor = ImageGenerator(tiny_klein, FAMILIES["flux2-klein-edit-4b"])
    source = png(generator.generate(ImageSpec("a puffin", 64, 64, 1, 1.0, seed=3)))
    edited = editor.generate(ImageSpec("make it dusk", 64, 64, 2, 1.0, seed=3, images=[source]))
    assert edited.size == (64, 64)
    assert png(edited) == png(editor.generate(ImageSpec("make it dusk", 64, 64, 2, 1.0, seed=3, images=[source])))
