"""What a model will hold in memory, known before it loads: its weights (from the files: safetensors headers at the
width it loads at, a GGUF's size, an image model's components), its KV budget and prefix cache for a chat model,
and a working margin for the others. Plain Python: files are read, nothing is loaded (issue 55).

Under a node memory budget a chat model gets a bounded KV budget and prefix cache where its config names none
(the engine's own defaults are shares of the whole device, one model at a time): `sized_config` writes them into
the config it loads with, so what was counted is what the engine takes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from deployments.config import ModelConfig
from engine.images.memory import image_model_bytes
from engine.models.quantize import kv_cache_bytes, read_safetensors_headers, weights_bytes

MIB = 1024**2
RESIDENT_KV_TOKENS = 32768  # a chat model's KV under a budget, where it names none: one request this long
RESIDENT_PREFIX_CACHE_BYTES = 256 * MIB  # its prefix cache, likewise
WORKING_SHARE = 0.25  # models without a KV budget (embeddings, speech): activations and buffers over the weights
# The embedded models' weights once loaded (their packages hold more than the one file each loads).
EMBEDDED_WEIGHTS = {"default": 270 * MIB, "default-embedding": 92 * MIB, "default-stt": 148 * MIB,
                    "default-tts": 64 * MIB}
CHAT_TYPES = ("lm", "multimodal")


@dataclass(frozen=True)
class Footprint:
    weights_bytes: int
    kv_bytes: int = 0  # the KV budget (chat models)
    cache_bytes: int = 0  # prefix cache, working margin

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.cache_bytes


def model_footprint(config: ModelConfig) -> Footprint:
    """`config`: resolved, its model_path the local folder (or file) it loads from, or an embedded model's name."""
    folder = None if config.uses_embedded_model else Path(config.model_path)
    weights = _weights(config, folder)
    if config.model_type not in CHAT_TYPES:
        return Footprint(weights, 0, int(weights * WORKING_SHARE))
    kv = config.kv_budget_bytes if config.kv_budget_bytes is not None else _request_kv(config, folder)
    prefix = config.prefix_cache_bytes if config.prefix_cache_bytes is not None else RESIDENT_PREFIX_CACHE_BYTES
    return Footprint(weights, kv, prefix if config.enable_prefix_cache else 0)


def sized_config(config: ModelConfig, footprint: Footprint) -> ModelConfig:
    """The config a chat model loads with under a budget: the KV budget and prefix cache it was counted with."""
    if config.model_type not in CHAT_TYPES:
        return config
    updates = {}
    if config.kv_budget_bytes is None:
        updates["kv_budget_bytes"] = footprint.kv_bytes
    if config.prefix_cache_bytes is None and config.enable_prefix_cache:
        updates["prefix_cache_bytes"] = footprint.cache_bytes
    return config.model_copy(update=updates) if updates else config


def _weights(config: ModelConfig, folder: Path | None) -> int:
    if folder is None or config.model_path in EMBEDDED_WEIGHTS:
        return EMBEDDED_WEIGHTS.get(config.model_path, 0)
    if config.model_type in ("image-generation", "image-edit"):
        return image_model_bytes(folder, config.quantize or 8)
    if folder.is_file():  # a GGUF
        return folder.stat().st_size
    if config.model_type in CHAT_TYPES and any(folder.glob("*.safetensors")):
        bits = config.quantize if isinstance(config.quantize, int) else None
        return weights_bytes(read_safetensors_headers(folder), bits)
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file() and f.suffix in _WEIGHT_SUFFIXES)


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".onnx", ".gguf", ".npz", ".pt")


def _request_kv(config: ModelConfig, folder: Path | None) -> int:
    """One request of the model's context (at most RESIDENT_KV_TOKENS) in 16-bit keys and values."""
    model_config = {}
    if folder is not None and (folder / "config.json").is_file():
        model_config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    text = model_config.get("text_config") or model_config
    context = config.context_length or int(text.get("max_position_embeddings") or RESIDENT_KV_TOKENS)
    tokens = min(context, RESIDENT_KV_TOKENS)
    return kv_cache_bytes(model_config, tokens) if model_config else 64 * MIB


__all__ = ["Footprint", "model_footprint", "sized_config"]
