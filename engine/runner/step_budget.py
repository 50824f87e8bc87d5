"""The per-step prefill budget, from the machine: as many prompt tokens as this device prefills in about
STEP_TARGET_S. A GPU-sized constant (16,384 tokens) made one CPU step run for minutes, during which nothing
else (cancellations, queue timeouts, health) could happen."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from engine.kv.batch_cache import new_request_cache
from engine.kv.quantized_kv import KVQuantization

log = logging.getLogger(__name__)

STEP_TARGET_S = 0.5
MIN_STEP_TOKENS = 32  # a slow CPU still moves a prompt forward by a prefix-cache block per step
MAX_STEP_TOKENS = 16384  # beyond this a GPU gains little and a step's decode rows wait longer
# The timed forward grows from FIRST_PROBE_TOKENS until one takes MIN_PROBE_S (a fast device's short forward
# times its launch overhead, not its speed), up to MAX_PROBE_TOKENS.
FIRST_PROBE_TOKENS = 16
MAX_PROBE_TOKENS = 1024
MIN_PROBE_S = 0.05


@dataclass(frozen=True)
class PrefillBudget:
    step_tokens: int
    tokens_per_s: float  # measured prefill speed of one sequence

    @property
    def expected_step_s(self) -> float:
        return self.step_tokens / self.tokens_per_s


def measure_prefill_budget(model: Any, context_length: int, quantization: KVQuantization | None = None) -> PrefillBudget:
    """Time single-sequence forwards of growing length (on the KV cache the engine will use: a quantized one
    prefills slower on some backends); the budget fills STEP_TARGET_S at the speed seen."""
    started = time.monotonic()
    longest = min(MAX_PROBE_TOKENS, context_length - 1)
    tokens = min(FIRST_PROBE_TOKENS, longest)
    while True:
        seconds = _probe(model, tokens, quantization)
        if seconds >= MIN_PROBE_S or tokens * 4 > longest:
            break
        tokens *= 4
    speed = tokens / max(seconds, 1e-6)
    budget = PrefillBudget(int(min(MAX_STEP_TOKENS, max(MIN_STEP_TOKENS, speed * STEP_TARGET_S))), speed)
    log.info(
        "prefill: %.0f tokens/s measured in %.1f s; step budget %d tokens (~%.2f s a step)",
        speed, time.monotonic() - started, budget.step_tokens, budget.expected_step_s,
    )
    return budget


def _probe(model: Any, num_tokens: int, quantization: KVQuantization | None = None) -> float:
    """Seconds of one forward of num_tokens. A GPU's first forward at a new length builds its kernels (6.6 s on
    the lent H200 at 16 tokens), so there one untimed forward comes first; a CPU builds none."""
    if mx.default_device() != mx.cpu:
        _timed_forward(model, num_tokens, quantization)
    return _timed_forward(model, num_tokens, quantization)


def _timed_forward(model: Any, num_tokens: int, quantization: KVQuantization | None) -> float:
    cache = new_request_cache(model, quantization)
    started = time.perf_counter()
    mx.eval(model(mx.zeros((1, num_tokens), mx.uint32), cache=cache))
    return time.perf_counter() - started
