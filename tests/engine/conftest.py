from __future__ import annotations

from pathlib import Path

import pytest

from engine.models.loader import LoadedModel, load_model
from tests.support.tiny_models import LLAMA, write_model, write_wordlevel_tokenizer


@pytest.fixture(scope="session")
def wordlevel_tokenizer_dir(tmp_path_factory) -> Path:
    return write_wordlevel_tokenizer(tmp_path_factory.mktemp("wordlevel"), vocab_size=256)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, wordlevel_tokenizer_dir) -> LoadedModel:
    """A 2-layer llama with peaky random weights (distinct greedy tokens) and a 256-word vocabulary."""
    folder = write_model(
        tmp_path_factory.mktemp("tiny-llama"), dict(LLAMA, vocab_size=256), wordlevel_tokenizer_dir, scale=3.0
    )
    return load_model(folder)


@pytest.fixture(scope="session")
def smollm_tokenizer_dir(tmp_path_factory) -> Path:
    """SmolLM2's real byte-level BPE tokenizer, taken from the converted default model."""
    from engine.models.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def tiny_bpe_llama(tmp_path_factory, smollm_tokenizer_dir) -> LoadedModel:
    """A tiny random llama over SmolLM2's 49,152-token byte-level BPE vocabulary."""
    config = dict(LLAMA, vocab_size=49152, bos_token_id=1, eos_token_id=2)
    folder = write_model(tmp_path_factory.mktemp("tiny-bpe"), config, smollm_tokenizer_dir, scale=4.0)
    return load_model(folder)


@pytest.fixture(scope="module")
def prompt(tiny_bpe_llama) -> list[int]:
    """The structured-output tests' prompt, in the tiny BPE model's tokens."""
    return tiny_bpe_llama.tokenizer.encode("Answer in JSON:")
