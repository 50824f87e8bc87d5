"""Load any local model folder that mlx-lm supports."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm import load as mlx_lm_load
from mlx_lm.utils import load_config as mlx_lm_load_config
from mlx_lm.utils import load_tokenizer as mlx_lm_load_tokenizer

from engine.errors import ModelLoadError
from engine.models.cpu_compute import choose_cpu_compute
from engine.mlx_settings import apply_mlx_settings

_CONTEXT_KEYS = ("max_position_embeddings", "max_seq_len", "seq_length", "n_ctx", "model_max_length")
_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
DEFAULT_CONTEXT_LENGTH = 4096


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: Any  # mlx_lm TokenizerWrapper
    config: dict[str, Any]
    path: Path

    @property
    def vocab_size(self) -> int:
        for section in (self.config, self.config.get("text_config") or {}):
            if "vocab_size" in section:
                return int(section["vocab_size"])
        return len(self.tokenizer)

    @property
    def context_length(self) -> int:
        return context_length_of(self.config)

    @property
    def longest_token_chars(self) -> int:
        """The most characters one token of the vocabulary writes (a byte-level token's string has one character a
        byte; a byte-fallback piece like <0x0A> counts 6 for 1 byte: an over-estimate is safe where it is used)."""
        try:
            return max((len(token) for token in self.tokenizer.get_vocab()), default=64)
        except (AttributeError, TypeError):
            return 64

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset(self.tokenizer.eos_token_ids)


def context_length_of(config: dict[str, Any]) -> int:
    """A model's own context length, from its config.json."""
    for section in (config, config.get("text_config") or {}):
        for key in _CONTEXT_KEYS:
            if isinstance(section.get(key), int):
                return int(section[key])
    return DEFAULT_CONTEXT_LENGTH


def load_model(
    path: str | Path,
    *,
    dtype: str | None = None,
    chat_template_file: str | Path | None = None,
    trust_remote_code: bool = False,
) -> LoadedModel:
    """Load weights and tokenizer from a local folder (never from a hub)."""
    apply_mlx_settings()  # before the weights reach the device: MLX reads its settings at first use
    folder = Path(path).expanduser().resolve()
    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"No model folder at '{path}' (config.json not found)")
    try:
        model, tokenizer = mlx_lm_load(
            str(folder),
            tokenizer_config={"trust_remote_code": trust_remote_code},
            trust_remote_code=trust_remote_code,
        )
    except Exception as exc:  # mlx-lm raises many types; report them as one
        raise ModelLoadError(f"Could not load model at '{path}': {exc}") from exc
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    if dtype is not None:
        cast_model(model, dtype)
    else:  # on the CPU backend, float32 where its matmuls are clearly faster (a GPU keeps the stored dtype)
        choose_cpu_compute(model, config)
    _set_chat_template(tokenizer, chat_template_file)
    return LoadedModel(model=model, tokenizer=tokenizer, config=config, path=folder)


def load_tokenizer_only(
    path: str | Path, *, chat_template_file: str | Path | None = None, trust_remote_code: bool = False
) -> Any:
    """The tokenizer load_model would return for this folder, without the weights (for a serving process
    whose engine runs elsewhere)."""
    folder = Path(path).expanduser().resolve()
    try:
        eos_token_ids = mlx_lm_load_config(folder).get("eos_token_id")
        tokenizer = mlx_lm_load_tokenizer(
            folder, {"trust_remote_code": trust_remote_code}, eos_token_ids=eos_token_ids
        )
    except Exception as exc:
        raise ModelLoadError(f"Could not load the tokenizer at '{path}': {exc}") from exc
    _set_chat_template(tokenizer, chat_template_file)
    return tokenizer


def _set_chat_template(tokenizer: Any, chat_template_file: str | Path | None) -> None:
    if chat_template_file is not None:
        tokenizer.chat_template = Path(chat_template_file).read_text(encoding="utf-8")


def cast_model(model: nn.Module, dtype: str) -> None:
    if dtype not in _DTYPES:
        raise ModelLoadError(f"Unsupported dtype '{dtype}' (choose from {sorted(_DTYPES)})")
    model.set_dtype(_DTYPES[dtype])
    mx.eval(model.parameters())
