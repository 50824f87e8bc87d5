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


def build_engine_core(spec: EngineSpec) -> "EngineCore":
    from engine.core import EngineCore
    from engine.runner.loader import load_model

    path = spec.model_path
    if spec.uses_default_model:
        from engine.models.default_model import default_model_path

        path = str(default_model_path())  # converts the embedded GGUF once, then reuses it
    load = load_model
    if spec.model_type == "multimodal":
        from engine.vision.loader import load_vision_model as load
    loaded = load(path, dtype=spec.dtype, chat_template_file=spec.chat_template_file, trust_remote_code=spec.trust_remote_code)
    return EngineCore(loaded, spec.engine_config)


def load_serving_processor(spec: EngineSpec, model_path: str | Path) -> Any:
    """A multimodal model's processor for the serving side (None for a text model); blocking, call it off the loop."""
    if spec.model_type != "multimodal":
        return None
    from engine.vision.loader import load_vision_processor

    return load_vision_processor(model_path, trust_remote_code=spec.trust_remote_code)
