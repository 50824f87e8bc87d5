"""The per-step prefill budget, from the machine: as many prompt tokens as this device prefills in about
STEP_TARGET_S, and no more than the memory left beside the weights, the KV budget and the prefix cache holds
while a forward runs. A GPU-sized constant (16,384 tokens) made one CPU step run for minutes, during which nothing
else (cancellations, queue timeouts, health) could happen; on an H100, Llama-3.1-8B's padded 16k-token prefill
forwards held up to 65 GB beside the weights (MLX keeps a forward's buffers until the device is done with them)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from engine.device_memory import reset_peak_memory
from engine.kv.batch_cache import new_request_cache
from engine.kv.quantized_kv import KVQuantization
from engine.runner.prefill_shapes import largest_step_within

log = logging.getLogger(__name__)

STEP_TARGET_S = 0.5
MIN_STEP_TOKENS = 32  # a slow CPU still moves a prompt forward by a prefix-cache block per step
MAX_STEP_TOKENS = 16384  # beyond this a GPU gains little and a step's decode rows wait longer
# The timed forward grows from FIRST_PROBE_TOKENS until one takes MIN_PROBE_S (a fast device's short forward
# times its launch overhead, not its speed), up to MAX_PROBE_TOKENS.
FIRST_PROBE_TOKENS = 16
MAX_PROBE_TOKENS = 1024
MIN_PROBE_S = 0.05
# The probe is one row, attending causally; a padded many-row forward attends through a mask and holds more per
# token (on an H100, Llama-3.1-8B: 2.88 MB a token at 26 rows x 256 against the probe's 2.41).
MASKED_FORWARD_MARGIN = 1.25


@dataclass(frozen=True)
class PrefillBudget:
    step_tokens: int
    tokens_per_s: float  # measured prefill speed of one sequence
    # What a forward held beyond what was allocated before it, per prompt token (activations, logits).
    transient_bytes_per_token: float = 0.0
    speed_step_tokens: int = 0  # the budget by speed alone, before the memory bound

    @property
    def expected_step_s(self) -> float:
        return self.step_tokens / self.tokens_per_s


def measure_prefill_budget(
    model: Any, context_length: int, quantization: KVQuantization | None = None, memory_allowance_bytes: int | None = None,
    max_rows: int = 32, chunk_tokens: int | None = None,
) -> PrefillBudget:
    """Time single-sequence forwards of growing length (on the KV cache the engine will use: a quantized one
    prefills slower on some backends); the budget fills STEP_TARGET_S at the speed seen, cut so that each padded
    forward of a step (max_rows rows, chunks of chunk_tokens) holds at most memory_allowance_bytes (None: unbounded)
    at the memory per token seen."""
    started = time.monotonic()
    longest = min(MAX_PROBE_TOKENS, context_length - 1)
    tokens = min(FIRST_PROBE_TOKENS, longest)
    while True:
        probe = _probe(model, tokens, quantization)
        if probe.seconds >= MIN_PROBE_S or tokens * 4 > longest:
            break
        tokens *= 4
    speed = tokens / max(probe.seconds, 1e-6)
    per_token = probe.transient_bytes / tokens
    by_speed = int(min(MAX_STEP_TOKENS, max(MIN_STEP_TOKENS, speed * STEP_TARGET_S)))
    step_tokens = by_speed
    if memory_allowance_bytes is not None and per_token > 0:
        forward_tokens = memory_allowance_bytes / (per_token * MASKED_FORWARD_MARGIN)
        step_tokens = largest_step_within(forward_tokens, max_rows, chunk_tokens, MIN_STEP_TOKENS, by_speed)
    budget = PrefillBudget(step_tokens, speed, per_token, by_speed)
    log.info(
        "prefill: %.0f tokens/s and %.2f MB held per token, measured in %.1f s; step budget %d tokens (~%.2f s a "
        "step; %d by speed; %.1f GB beside the KV budget)", speed, per_token / 1e6, time.monotonic() - started,
        budget.step_tokens, budget.expected_step_s, by_speed, (memory_allowance_bytes or 0) / 1e9,
    )
    return budget


@dataclass(frozen=True)
class ProbeForward:
    seconds: float
    transient_bytes: int  # the forward's peak allocation beyond what was held before it


def _probe(model: Any, num_tokens: int, quantization: KVQuantization | None = None) -> ProbeForward:
    """One forward of num_tokens. A GPU's first forward at a new length builds its kernels (6.6 s on the lent H200
    at 16 tokens), so there one untimed forward comes first; a CPU builds none."""
    if mx.default_device() != mx.cpu:
        _timed_forward(model, num_tokens, quantization)
    return _timed_forward(model, num_tokens, quantization)


def _timed_forward(model: Any, num_tokens: int, quantization: KVQuantization | None) -> ProbeForward:
    cache = new_request_cache(model, quantization)
    held_before = mx.get_active_memory()
    reset_peak_memory()
    started = time.perf_counter()
    mx.eval(model(mx.zeros((1, num_tokens), mx.uint32), cache=cache))
    seconds = time.perf_counter() - started
    return ProbeForward(seconds, max(0, mx.get_peak_memory() - held_before))
