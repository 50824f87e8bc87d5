"""Warm-up at load of what a decode batch of several rows first runs, on a GPU.

On MLX's CUDA backend the first decode of rows of unequal lengths (the left padding and its mask), rows joining a
running batch and rows leaving it build kernels. Measured on an H200 (issue 57, an 8B model, no warm-up by the
client): after a lone stream, the first 8-stream level had steps of ~1.5 s (ITL P99 1,562 ms against a P50 of
9.8 ms) and ran at 0.62x mlx_lm.server. The padded prefill shapes' warm-up (runner/warmup.py) covers prefill only.

A throwaway EngineCore on the same loaded model runs short requests of unequal prompts that join at doubling widths
up to the engine's decode rows: the serving core's counters, prefix cache and KV stay untouched (built kernels
belong to the process). No warm-up on the CPU, whose kernels are built ahead of time.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from engine.core import EngineCore
from engine.device_memory import on_gpu
from engine.request import Request
from engine.sampling.params import SamplingParams

log = logging.getLogger(__name__)

DECODE_WARMUP_S = 30.0  # at most, within prefill_warmup_seconds: compiles take ~1 s each where they happen


def warm_up_at_load(core: EngineCore) -> None:
    """What every engine client does before its first request: the runner's warm-up (a first forward, the padded
    prefill shapes, speculation's costs), then the decode batch's."""
    core.runner.warmup()
    warm_decode_batch(core)


def warm_decode_batch(core: EngineCore, time_budget_s: float | None = None) -> int:
    """Steps run by the throwaway core. The budget by default: none on the CPU, else DECODE_WARMUP_S within
    prefill_warmup_seconds."""
    budget = time_budget_s
    if budget is None:
        budget = min(DECODE_WARMUP_S, core.config.prefill_warmup_seconds) if on_gpu() else 0.0
    if budget <= 0:
        return 0
    started = time.monotonic()
    config = replace(core.config, enable_prefix_cache=False, speculative=None, max_loras=0)
    throwaway = EngineCore(core.loaded, config)
    vocab, steps, made = core.loaded.vocab_size, 0, 0
    try:
        width = 2
        while width <= config.max_decode_seqs and time.monotonic() - started < budget:
            for _ in range(width - len(throwaway.scheduler.running) - len(throwaway.scheduler.waiting)):
                throwaway.add_request(throwaway.limits.validate(_row(made, vocab)))
                made += 1
            for _ in range(3):  # joined rows decode beside the running ones; the shortest answers leave
                throwaway.step()
                steps += 1
            width *= 2
        while throwaway.has_unfinished_requests() and time.monotonic() - started < budget:
            throwaway.step()
            steps += 1
    finally:
        throwaway.close()
    log.info("decode warm-up: %d rows joining at doubling widths, %d steps in %.1f s", made, steps,
             time.monotonic() - started)
    return steps


def _row(index: int, vocab: int) -> Request:
    """A short prompt of its own length (3..25 tokens) and answer (3..6 tokens): rows of unequal lengths."""
    length = 3 + (index * 7) % 23
    tokens = [(index + 11 * i) % vocab for i in range(length)]
    return Request(f"decode-warmup-{index}", tokens,
                   SamplingParams(max_tokens=3 + index % 4, temperature=0.0, ignore_eos=True))


__all__ = ["DECODE_WARMUP_S", "warm_decode_batch", "warm_up_at_load"]
