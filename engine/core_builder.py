"""Build an EngineCore from a CoreSpec: in the serving process's engine thread (AsyncEngine) or in the
engine's own process (engine_child.py)."""

from __future__ import annotations

from engine.core import EngineCore
from engine.process_protocol import CoreSpec


def build_engine_core(spec: CoreSpec, core_type: type[EngineCore] = EngineCore) -> EngineCore:
    """core_type: EngineCore, or a subclass of it (bench/timed_core.py times the steps of one)."""
    from engine.runner.loader import load_model

    path = spec.model_path
    if spec.uses_default_model:
        from engine.models.default_model import default_model_path

        path = str(default_model_path())  # converts the embedded GGUF once, then reuses it
    loaded = load_model(
        path, dtype=spec.dtype, chat_template_file=spec.chat_template_file, trust_remote_code=spec.trust_remote_code
    )
    return core_type(loaded, spec.engine_config)
