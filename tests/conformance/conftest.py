"""The models every conformance module serves, built once per session: the Hub stand-in serves the same two folders
under every repo id the docs name (a scripted tiny llama for the language models, a scripted tiny Qwen2.5-VL for
the multimodal ones; tests/support/scripted_models.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.scripted_models import write_scripted_lm, write_scripted_vlm

# The docs' language-model repos (L33, L55, L72, L102, L418, L620, L829-830) and multimodal ones (L63, L428).
RAPTOR = "SRSWTI/bodega-raptor-8b-mxfp4"
RAPTOR_09B = "SRSWTI/bodega-raptor-0.9b"
REASONING_DISTILL = "SRSWTI/bodega-raptor-1b-reasoning-opus4.5-distill"  # L830
ORION = "srswti/bodega-orion-0.6b"
BLACKBIRD = "srswti/blackbird-she-doesnt-refuse-21b"
QWEN3_30B = "Qwen/Qwen3-30B-A3B-MLX-4bit"
QWEN3_8B = "mlx-community/Qwen3-8B-4bit"
QWEN3_DRAFT = "Qwen/Qwen3-0.6B-MLX-4bit"
SOLOMON = "srswti/bodega-solomon-9b"
QWEN35_VL = "mlx-community/Qwen3.5-27B-4bit"


@pytest.fixture(scope="session")
def lm_folder(tmp_path_factory) -> Path:
    return write_scripted_lm(tmp_path_factory.mktemp("bodega-lm") / "model")


@pytest.fixture(scope="session")
def vlm_folder(tmp_path_factory) -> Path:
    return write_scripted_vlm(tmp_path_factory.mktemp("bodega-vlm") / "model")


@pytest.fixture(scope="session")
def prompt_opens_think_lm_folder(tmp_path_factory) -> Path:
    """The same script under a Qwen3-2507 thinking template: the generation prompt itself ends with <think>."""
    return write_scripted_lm(tmp_path_factory.mktemp("bodega-lm-2507") / "model", prompt_opens_think=True)
