"""LoRA adapter folders read into one form: per target module, A [in, r] and B [r, out] in float32 and a scale.

Two formats: mlx-lm's (`adapters.safetensors` + `adapter_config.json` from `mlx_lm lora`: lora_a/lora_b already
[in, r]/[r, out], `lora_parameters.scale`) and PEFT's (`adapter_model.safetensors` + `adapter_config.json`: lora_A
[r, in] and lora_B [out, r] transposed here, scale lora_alpha / r, or / sqrt(r) with use_rslora). Either way the
update is y = x Wᵀ + scale · (x A) B, mlx-lm's LoRALinear. What cannot be served that way (DoRA, full fine-tunes,
embedding LoRA, biases, modules_to_save) is refused with the reason, as is a module the model does not have or a
shape that does not fit it.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from engine.errors import InvalidRequestError

MLX_LM_WEIGHTS = "adapters.safetensors"
PEFT_WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class LoraDelta:
    """One module's low-rank update: scale · (x a) b."""

    a: mx.array  # [in, r] float32
    b: mx.array  # [r, out] float32
    scale: float

    @property
    def rank(self) -> int:
        return int(self.a.shape[1])


@dataclass(frozen=True)
class AdapterWeights:
    path: Path
    source_format: str  # "mlx-lm" | "peft"
    deltas: dict[str, LoraDelta] = field(default_factory=dict)  # module path (model.named_modules()) -> update

    @property
    def rank(self) -> int:
        return max(delta.rank for delta in self.deltas.values())

    @property
    def nbytes(self) -> int:
        return sum(delta.a.nbytes + delta.b.nbytes for delta in self.deltas.values())


def read_adapter(folder: Path, model: nn.Module, param: str, max_rank: int | None = None) -> AdapterWeights:
    """The adapter in `folder`, checked against `model`; InvalidRequestError (naming `param`) if it cannot serve."""
    if not folder.is_dir():
        raise InvalidRequestError(f"'{param}': no adapter folder at '{folder}'", param=param)
    config = _read_config(folder, param)
    if (folder / MLX_LM_WEIGHTS).is_file():
        weights = AdapterWeights(folder, "mlx-lm", _mlx_lm_deltas(folder, config, param))
    elif (folder / PEFT_WEIGHTS).is_file():
        weights = AdapterWeights(folder, "peft", _peft_deltas(folder, config, param))
    else:
        raise InvalidRequestError(
            f"'{param}': '{folder}' holds neither {MLX_LM_WEIGHTS} (mlx-lm) nor {PEFT_WEIGHTS} (PEFT); "
            "adapters are read from safetensors only", param=param)
    if not weights.deltas:
        raise InvalidRequestError(f"'{param}': the adapter at '{folder}' holds no LoRA weights", param=param)
    _check_against_model(weights, model, param)
    if max_rank is not None and weights.rank > max_rank:
        raise InvalidRequestError(
            f"'{param}': the adapter at '{folder}' has rank {weights.rank}, over this model's max_lora_rank "
            f"{max_rank}", param=param)
    return weights


def _read_config(folder: Path, param: str) -> dict[str, Any]:
    try:
        config = json.loads((folder / CONFIG).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InvalidRequestError(f"'{param}': '{folder}' has no {CONFIG}", param=param) from None
    except (OSError, ValueError) as exc:
        raise InvalidRequestError(f"'{param}': cannot read {folder / CONFIG}: {exc}", param=param) from None
    if not isinstance(config, dict):
        raise InvalidRequestError(f"'{param}': {folder / CONFIG} is not a JSON object", param=param)
    return config


def _load_tensors(path: Path, param: str) -> dict[str, mx.array]:
    try:
        return mx.load(str(path))
    except Exception as exc:  # MLX raises RuntimeError/ValueError for a damaged file
        raise InvalidRequestError(f"'{param}': cannot read {path}: {exc}", param=param) from None


def _mlx_lm_deltas(folder: Path, config: dict[str, Any], param: str) -> dict[str, LoraDelta]:
    kind = config.get("fine_tune_type", "lora")
    if kind != "lora":
        raise InvalidRequestError(
            f"'{param}': fine_tune_type '{kind}' cannot be served as a LoRA (only 'lora'; fuse a DoRA or full "
            "fine-tune into the model instead)", param=param)
    parameters = config.get("lora_parameters") or {}
    scale = parameters.get("scale")
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale):
        raise InvalidRequestError(f"'{param}': lora_parameters.scale must be a number, not {scale!r}", param=param)
    tensors = _load_tensors(folder / MLX_LM_WEIGHTS, param)
    pairs = _pairs(tensors, ".lora_a", ".lora_b", param)
    return {module: LoraDelta(a.astype(mx.float32), b.astype(mx.float32), float(scale)) for module, (a, b) in pairs.items()}


def _peft_deltas(folder: Path, config: dict[str, Any], param: str) -> dict[str, LoraDelta]:
    _refuse_peft_features(config, param)
    tensors = _load_tensors(folder / PEFT_WEIGHTS, param)
    stripped = {key.removeprefix(PEFT_PREFIX): value for key, value in tensors.items()}
    pairs = _pairs(stripped, ".lora_A.weight", ".lora_B.weight", param)
    deltas = {}
    for module, (lora_a, lora_b) in pairs.items():
        rank = int(lora_a.shape[0])
        alpha = _pattern_value(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", 8))
        if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
            raise InvalidRequestError(f"'{param}': lora_alpha must be a number, not {alpha!r}", param=param)
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        deltas[module] = LoraDelta(lora_a.T.astype(mx.float32), lora_b.T.astype(mx.float32), float(scale))
    return deltas


def _refuse_peft_features(config: dict[str, Any], param: str) -> None:
    peft_type = config.get("peft_type", "LORA")
    problems = {
        f"peft_type '{peft_type}' (only LORA)": peft_type != "LORA",
        "use_dora (DoRA rescales each weight row: fuse it into the model instead)": bool(config.get("use_dora")),
        "modules_to_save (whole trained modules, not a low-rank update)": bool(config.get("modules_to_save")),
        f"bias '{config.get('bias')}' (trained biases)": config.get("bias", "none") not in (None, "none"),
        "fan_in_fan_out (GPT-2's Conv1D layout)": bool(config.get("fan_in_fan_out")),
    }
    refused = [name for name, present in problems.items() if present]
    if refused:
        raise InvalidRequestError(f"'{param}': this PEFT adapter cannot be served: {'; '.join(refused)}", param=param)


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's rank_pattern/alpha_pattern: a key names a module by its path's ending (or a regex of it)."""
    for key, value in patterns.items():
        if module == key or module.endswith("." + key) or re.fullmatch(rf"(.*\.)?{key}", module):
            return value
    return default


def _pairs(tensors: dict[str, mx.array], a_suffix: str, b_suffix: str, param: str) -> dict[str, tuple[mx.array, mx.array]]:
    """{module path: (A, B)} from keys `<module><a_suffix>` / `<module><b_suffix>`; anything else is refused."""
    a_of = {k.removesuffix(a_suffix): v for k, v in tensors.items() if k.endswith(a_suffix)}
    b_of = {k.removesuffix(b_suffix): v for k, v in tensors.items() if k.endswith(b_suffix)}
    others = sorted(k for k in tensors if not (k.endswith(a_suffix) or k.endswith(b_suffix)))
    if others:
        what = "an embedding LoRA or DoRA magnitudes" if any("embedding" in k or k.endswith((".m", "magnitude_vector"))
                                                             for k in others) else "not LoRA A/B weights"
        raise InvalidRequestError(
            f"'{param}': the adapter holds {len(others)} tensors that are {what}, e.g. {', '.join(others[:3])}",
            param=param)
    unpaired = sorted(set(a_of) ^ set(b_of))
    if unpaired:
        raise InvalidRequestError(f"'{param}': LoRA A without B (or B without A) for {', '.join(unpaired[:3])}",
                                  param=param)
    return {module: (a_of[module], b_of[module]) for module in sorted(a_of)}


def linear_dims(module: nn.Module) -> tuple[int, int] | None:
    """(input, output) features of a Linear or QuantizedLinear (seen through LoRA wrappers); None otherwise."""
    if isinstance(module, nn.QuantizedLinear):
        out_dims, packed = module.weight.shape
        return packed * 32 // module.bits, out_dims
    if isinstance(module, nn.Linear):
        out_dims, in_dims = module.weight.shape
        return in_dims, out_dims
    for wrapped in ("base", "linear"):  # our MultiLoraLinear's child, mlx-lm's LoRALinear's
        inner = module.get(wrapped) if isinstance(module, dict) else None
        if isinstance(inner, nn.Module):
            return linear_dims(inner)
    return None


def _check_against_model(weights: AdapterWeights, model: nn.Module, param: str) -> None:
    modules = dict(model.named_modules())
    for path, delta in weights.deltas.items():
        module = modules.get(path)
        dims = linear_dims(module) if module is not None else None
        if dims is None:
            what = "has no module" if module is None else f"has a {type(module).__name__}, not a linear layer,"
            raise InvalidRequestError(f"'{param}': the model {what} at '{path}' (an adapter for another model?)",
                                      param=param)
        in_dims, out_dims = dims
        if delta.a.ndim != 2 or delta.b.ndim != 2 or delta.a.shape[1] != delta.b.shape[0]:
            raise InvalidRequestError(f"'{param}': A {delta.a.shape} and B {delta.b.shape} of '{path}' do not pair",
                                      param=param)
        if delta.a.shape[0] != in_dims or delta.b.shape[1] != out_dims:
            raise InvalidRequestError(
                f"'{param}': '{path}' is {in_dims} -> {out_dims} in the model but the adapter's A {tuple(delta.a.shape)} "
                f"and B {tuple(delta.b.shape)} are for {delta.a.shape[0]} -> {delta.b.shape[1]} (another model?)",
                param=param)


__all__ = ["AdapterWeights", "LoraDelta", "linear_dims", "read_adapter"]
