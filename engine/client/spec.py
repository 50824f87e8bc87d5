"""EngineSpec: how an engine is built (a model folder or the embedded default model, and its config), and the
builder both engine clients use: on the thread client's engine thread, or in the engine process."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.config import EngineConfig

if TYPE_CHECKING:
    from engine.core import EngineCore


@dataclass(frozen=True)
class EngineSpec:
    model_path: str
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
    loaded = load_model(
        path, dtype=spec.dtype, chat_template_file=spec.chat_template_file, trust_remote_code=spec.trust_remote_code
    )
    return EngineCore(loaded, spec.engine_config)
