"""An image model's memory, reckoned from its folder before it loads (engine/images/memory.py)."""

from __future__ import annotations

import pytest

from engine.errors import InsufficientMemoryError
from engine.images.memory import WORKING_SHARE, check_fits, image_model_bytes


@pytest.fixture
def folder(tmp_path):
    for component, size in (("transformer", 800), ("text_encoder", 400), ("vae", 200)):
        (tmp_path / component).mkdir()
        (tmp_path / component / "0.safetensors").write_bytes(b"\0" * size)
        (tmp_path / component / "config.json").write_text("{}")  # not weights
    (tmp_path / "tokenizer").mkdir()
    return tmp_path


def test_quantizing_shrinks_the_transformer_and_text_encoder_but_not_the_vae(folder):
    assert image_model_bytes(folder, None) == image_model_bytes(folder, 16) == int(1400 * (1 + WORKING_SHARE))
    assert image_model_bytes(folder, 8) == int((600 + 200) * (1 + WORKING_SHARE))
    assert image_model_bytes(folder, 4) == int((300 + 200) * (1 + WORKING_SHARE))


def test_a_model_that_does_not_fit_is_refused_naming_both_sizes_and_the_way_out(folder):
    check_fits("klein", folder, 8, free_bytes=1000)
    check_fits("klein", folder, None, free_bytes=None)  # the OS does not say: not checked here
    with pytest.raises(InsufficientMemoryError) as refused:
        check_fits("klein", folder, None, free_bytes=1000)
    assert refused.value.code == "insufficient_memory"
    assert "'klein' needs about" in refused.value.message and "quantize 4" in refused.value.message
