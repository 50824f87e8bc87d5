"""Random LoRA adapters for the tiny test models, written in mlx-lm's format or PEFT's."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from engine.adapters.weights import linear_dims

ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")


def random_lora(model: nn.Module, rank: int, seed: int, targets: tuple[str, ...] = ATTENTION,
                magnitude: float = 0.5) -> dict[str, tuple[mx.array, mx.array]]:
    """{module path: (A [in, r], B [r, out])} for `targets` of every layer; large enough to change greedy tokens."""
    mx.random.seed(seed)
    modules = dict(model.named_modules())
    pairs = {}
    for index in range(len(model.layers)):
        for target in targets:
            path = f"model.layers.{index}.{target}"
            in_dims, out_dims = linear_dims(modules[path])
            pairs[path] = (mx.random.normal((in_dims, rank)) * magnitude / rank**0.5,
                           mx.random.normal((rank, out_dims)) * magnitude / rank**0.5)
    return pairs


def write_mlx_lm_adapter(folder: Path, pairs: dict[str, tuple[mx.array, mx.array]], scale: float) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rank = next(iter(pairs.values()))[0].shape[1]
    weights = {}
    for path, (a, b) in pairs.items():
        weights[f"{path}.lora_a"], weights[f"{path}.lora_b"] = a, b
    mx.save_safetensors(str(folder / "adapters.safetensors"), weights)
    config = {"fine_tune_type": "lora", "num_layers": -1, "model": "tiny",
              "lora_parameters": {"rank": rank, "scale": scale, "dropout": 0.0}}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def write_peft_adapter(folder: Path, pairs: dict[str, tuple[mx.array, mx.array]], alpha: float,
                       rslora: bool = False, **config) -> Path:
    """PEFT's layout: lora_A [r, in], lora_B [out, r] under base_model.model., scale alpha / r (or / sqrt(r))."""
    folder.mkdir(parents=True, exist_ok=True)
    rank = next(iter(pairs.values()))[0].shape[1]
    weights = {}
    for path, (a, b) in pairs.items():
        weights[f"base_model.model.{path}.lora_A.weight"] = a.T
        weights[f"base_model.model.{path}.lora_B.weight"] = b.T
    mx.save_safetensors(str(folder / "adapter_model.safetensors"), weights)
    targets = sorted({path.rsplit(".", 1)[1] for path in pairs})
    settings = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "use_rslora": rslora, "bias": "none",
                "target_modules": targets, "task_type": "CAUSAL_LM", **config}
    (folder / "adapter_config.json").write_text(json.dumps(settings))
    return folder
