"""ServedModel: what the serving side needs from a started engine, wherever the engine runs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ServedModel:
    tokenizer: Any  # mlx_lm TokenizerWrapper, loaded in the serving process
    context_length: int
    path: Path
    # True when the engine steps in a child process (ProcessEngine): its CPU and memory are not this process's.
    in_own_process: bool
