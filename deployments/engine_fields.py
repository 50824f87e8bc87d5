"""EngineConfig's knobs as pydantic fields: a model's engine fields in serve_config.yaml and the admin API.

The engine declares each knob once (engine/config.py: type, default, bounds, meaning); these models take all of it
from there, so a knob's default, limits and description are written in one place. Pydantic checks types and bounds
field by field (its errors name the field); ModelConfig then builds the EngineConfig, which checks the rest.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, get_type_hints

from pydantic import BaseModel, ConfigDict, Field, create_model

from engine.config import EngineConfig, knobs

# Internal knobs with measured defaults: under a model's `advanced:`, to measure with, not to tune.
ADVANCED_KNOBS = ("pad_prefill_shapes", "prefill_warmup_seconds", "slow_step_log_seconds")
# Knobs a served model keeps at the engine's default.
FIXED_KNOBS = ("prefix_block_size", "seed")
# Every other knob is a top-level field of a model.
MODEL_KNOBS = tuple(name for name in knobs() if name not in ADVANCED_KNOBS + FIXED_KNOBS)
# A server bounds its queue and a request's wait in it; the engine alone leaves that to its caller.
SERVING_DEFAULTS: dict[str, Any] = {"queue_size": 100, "queue_timeout": 300.0}


def knob_fields_model(model_name: str, names: tuple[str, ...], doc: str) -> type[BaseModel]:
    """A pydantic model whose fields are these knobs, as the engine declares them (unknown fields refused)."""
    types = get_type_hints(EngineConfig)
    defaults = {field.name: field.default for field in fields(EngineConfig)}
    declared = knobs()
    definitions: dict[str, Any] = {}
    for name in names:
        knob = declared[name]
        default = SERVING_DEFAULTS.get(name, defaults[name])
        definitions[name] = (types[name], Field(default, description=knob.doc, ge=knob.ge, gt=knob.gt, le=knob.le))
    return create_model(model_name, __config__=ConfigDict(extra="forbid"), __doc__=doc, __module__=__name__,
                        **definitions)


EngineKnobs = knob_fields_model("EngineKnobs", MODEL_KNOBS, "The engine's knobs a model sets at its top level.")
AdvancedEngineKnobs = knob_fields_model(
    "AdvancedEngineKnobs", ADVANCED_KNOBS, "The engine's internal knobs, under a model's `advanced:`.")
