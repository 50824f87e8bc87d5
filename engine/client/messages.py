"""Every message an engine client and its engine loop exchange, as typed dataclasses.

To the engine (a queue in the thread client, a socket in the process client): an EngineSpec first (process
client only), then AddRequest / AbortRequest / Shutdown. From the engine process: EngineReady or EngineFailed,
then StepOutputs and StatsUpdate, and EngineDied if its loop fails. Over the socket each message is one pickled
dataclass (multiprocessing.connection framing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

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
