"""Model folders load through mlx-lm, with a chat template override and clear errors."""

from __future__ import annotations

import mlx.core as mx
import pytest

from engine.errors import ModelLoadError
from engine.models.loader import load_model
from tests.support.tiny_models import model_dtype


def test_chat_template_file_overrides_the_folders_template(tiny_llama, tmp_path):
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}>>")
    loaded = load_model(tiny_llama.path, chat_template_file=template)
    rendered = loaded.tokenizer.apply_chat_template([{"role": "user", "content": "t5 t6"}], tokenize=False)
    assert rendered == "[user] t5 t6\n>>"
    default = tiny_llama.tokenizer.apply_chat_template([{"role": "user", "content": "t5"}], tokenize=False)
    assert default.startswith("<|im_start|>user")


def test_dtype_cast_and_model_facts(tiny_llama):
    loaded = load_model(tiny_llama.path, dtype="bfloat16")
    assert model_dtype(loaded.model) == mx.bfloat16
    assert (loaded.vocab_size, loaded.context_length) == (256, 2048)
    assert loaded.eos_token_ids == frozenset({255})


def test_missing_folder_and_bad_dtype_are_clear_errors(tmp_path, tiny_llama):
    with pytest.raises(ModelLoadError, match="config.json not found"):
        load_model(tmp_path / "nothing-here")
    with pytest.raises(ModelLoadError, match="Unsupported dtype"):
        load_model(tiny_llama.path, dtype="int3")
