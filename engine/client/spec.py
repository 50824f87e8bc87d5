"""EngineSpec: how an engine is built (a model folder or the embedded default model, and its config), and the
builder both engine clients use: on the thread client's engine thread, or in the engine process."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.config import EngineConfig

if TYPE_CHECKING:
    from engine.core import EngineCore


@dataclass(frozen=True)
class EngineSpec:
    model_path: str
    # "lm" (mlx-lm) or "multimodal" (a vision-language model through mlx-vlm).
    model_type: str = "lm"
    uses_default_model: bool = False
    dtype: str | None = None
    chat_template_file: str | None = None
    trust_remote_code: bool = False
    engine_config: EngineConfig | None = None
    # The engine process's GIL switch interval (None: Python's 5 ms); its engine thread shares the GIL only
    # with the threads that read commands and compile structured-output guides.
    gil_switch_interval_s: float | None = None
    # 4 or 8: load the weights quantized to that width (converted once into the model cache); "auto": the widest
    # that fits memory_budget_bytes (None: the memory MLX can use now) with one full-context request's KV cache.
    quantize: int | str | None = None
    memory_budget_bytes: int | None = None
    # LoRA adapters applied to every request from load on (Bodega's lora_paths / lora_scales: engine/adapters/fuse.py).
    lora_paths: tuple[str, ...] = ()
    lora_scales: tuple[float, ...] = ()


def build_engine_core(spec: EngineSpec) -> "EngineCore":
    from engine.core import EngineCore
    from engine.models.loader import load_model

    path = spec.model_path
    if spec.uses_default_model:
        from engine.models.default_model import default_model_path

        path = str(default_model_path())  # converts the embedded GGUF once, then reuses it
    elif path.endswith(".gguf"):  # a repo's GGUF file (gguf_file): converted once by the same import
        from engine.models.default_model import gguf_model_folder

        path = str(gguf_model_folder(Path(path)))
    if spec.quantize is not None:
        path = _quantized_path(spec, path)
    load = load_model
    if spec.model_type == "multimodal":
        from engine.vision.loader import load_vision_model as load
    loaded = load(path, dtype=spec.dtype, chat_template_file=spec.chat_template_file, trust_remote_code=spec.trust_remote_code)
    if spec.lora_paths:
        from engine.adapters.fuse import LoadTimeAdapter, apply_load_time_adapters, lora_scales_for

        scales = lora_scales_for(list(spec.lora_paths), list(spec.lora_scales))
        apply_load_time_adapters(loaded.model, [LoadTimeAdapter(Path(p), s) for p, s in zip(spec.lora_paths, scales)])
    return EngineCore(loaded, spec.engine_config, draft=_load_draft(spec))


def _load_draft(spec: EngineSpec):
    """The draft model of a `draft` speculative config (its tokenizer is checked against the target's by the core)."""
    speculative = spec.engine_config.speculative if spec.engine_config is not None else None
    if speculative is None or speculative.draft_model_path is None:
        return None
    from engine.models.loader import load_model

    return load_model(speculative.draft_model_path, dtype=spec.dtype, trust_remote_code=spec.trust_remote_code)


def _quantized_path(spec: EngineSpec, path: str) -> str:
    """The folder to load for spec.quantize: `path` itself, or its quantized copy in the model cache."""
    import json
    import logging

    from engine.models.default_model import models_root
    from engine.models.quantize import plan_quantization, quantized_folder
    from engine.models.loader import context_length_of

    folder = Path(path).expanduser().resolve()
    context_length = (spec.engine_config and spec.engine_config.context_length) or context_length_of(
        json.loads((folder / "config.json").read_text(encoding="utf-8")))
    plan = plan_quantization(folder, spec.quantize, context_length, spec.memory_budget_bytes)  # type: ignore[arg-type]
    logging.getLogger(__name__).info("quantize=%s for %s: %s", spec.quantize, folder, plan.describe())
    if plan.bits is None:
        return str(folder)
    return str(quantized_folder(folder, plan.bits, models_root(), spec.trust_remote_code))


def load_serving_processor(spec: EngineSpec, model_path: str | Path) -> Any:
    """A multimodal model's processor for the serving side (None for a text model); blocking, call it off the loop."""
    if spec.model_type != "multimodal":
        return None
    from engine.vision.loader import load_vision_processor

    return load_vision_processor(model_path, trust_remote_code=spec.trust_remote_code)
