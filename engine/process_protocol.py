"""What ProcessEngine (the serving process) and engine_child.py (the engine's process) send each other.

Parent to child: one CoreSpec, then engine_loop's AddCommand / AbortCommand / ShutdownCommand.
Child to parent: ChildReady or ChildFailed, then StepOutputs and StatsUpdate, and ChildDied if the loop fails.
Every message is a pickled dataclass over one socket pair (multiprocessing.connection framing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.config import EngineConfig
from engine.errors import OrchardError
from engine.output.events import RequestOutput

if TYPE_CHECKING:
    from engine.core import EngineStats


@dataclass(frozen=True)
class CoreSpec:
    """How the child builds its EngineCore: a local model folder, or the embedded default model."""

    model_path: str
    uses_default_model: bool = False
    dtype: str | None = None
    chat_template_file: str | None = None
    trust_remote_code: bool = False
    engine_config: EngineConfig | None = None
    # The child's GIL switch interval (None: Python's 5 ms); its engine thread shares the GIL only with the
    # threads that read commands and compile structured-output guides.
    gil_switch_interval_s: float | None = None


@dataclass
class ChildReady:
    model_path: str  # the folder actually loaded (the default model's converted one)
    context_length: int
    vocab_size: int
    stats: "EngineStats"


@dataclass
class ChildFailed:
    error: OrchardError


@dataclass
class StepOutputs:
    outputs: list[RequestOutput]


@dataclass
class StatsUpdate:
    stats: "EngineStats"


@dataclass
class ChildDied:
    message: str
