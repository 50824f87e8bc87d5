"""Every message an engine client and its engine loop exchange, as typed dataclasses.

To the engine (a queue in the thread client, a socket in the process client): an EngineSpec first (process
client only), then AddRequest / AbortRequest / AdapterCommand / Shutdown. From the engine process: EngineReady or
EngineFailed, then StepOutputs, StatsUpdate and AdapterReply, and EngineDied if its loop fails. Over the socket each
message is one pickled dataclass (multiprocessing.connection framing).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from engine.adapters.registry import LoadedAdapter
from engine.errors import OrchardError
from engine.kv.budget import KVBudget
from engine.output.request_output import RequestOutput
from engine.request import Request

if TYPE_CHECKING:
    from engine.core import EngineStats


# ---- to the engine ------------------------------------------------------------------------------
@dataclass
class AddRequest:
    request: Request


@dataclass
class AbortRequest:
    request_id: str


@dataclass
class Shutdown:
    pass


@dataclass
class AdapterCommand:
    """Load a per-request LoRA adapter (`path` given) or unload one (None); answered by an AdapterReply."""

    call_id: int
    name: str
    path: Path | None = None


@dataclass
class AdapterReply:
    """The engine's adapters after an AdapterCommand, or why it failed (nothing changed then)."""

    call_id: int
    adapters: list[LoadedAdapter] = field(default_factory=list)
    error: OrchardError | None = None


# ---- from the engine process ----------------------------------------------------------------------
@dataclass
class EngineReady:
    model_path: str  # the folder actually loaded (the default model's converted one)
    context_length: int
    vocab_size: int
    stats: "EngineStats"
    kv_budget: KVBudget | None = None
    token_chars: int = 64  # the most characters one token writes (RequestLimits)


@dataclass
class EngineFailed:
    error: OrchardError


@dataclass
class StepOutputs:
    outputs: list[RequestOutput]


@dataclass
class StatsUpdate:
    stats: "EngineStats"


@dataclass
class EngineDied:
    message: str
