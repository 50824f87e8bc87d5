"""Warm-up at load: run one forward per padded prefill shape, so no request pays for building them."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import mlx.core as mx

from engine.config import EngineConfig
from engine.kv.batch_cache import LayerCaches, cache_arrays, new_request_cache
from engine.kv.quantized_kv import KVQuantization
from engine.models.head_split import HeadSplit
from engine.runner.prefill import run_prefill
from engine.runner.prefill_shapes import WarmupShape, warmup_shapes
from engine.scheduler_output import PrefillChunk

log = logging.getLogger(__name__)


def warm_prefill_shapes(
    model: Any, shapes: list[WarmupShape], new_cache: Callable[[], LayerCaches], time_budget_s: float,
    vocab_size: int, max_rows: int, split: HeadSplit | None = None,
) -> int:
    """Run the shapes in order until the time budget is spent; returns how many ran.
    `max_rows` is the engine's prefill row limit (the row buckets serving pads to)."""
    started = time.monotonic()
    done = 0
    for shape in shapes:
        if time.monotonic() - started > time_budget_s:
            log.warning("prefill warm-up stopped after %.0f s: %d of %d shapes", time_budget_s, done, len(shapes))
            break
        # A non-completing chunk is the start of a longer prompt.
        tokens = (0,) * shape.length
        chunks = [PrefillChunk(f"warmup-{row}", 0, tokens, shape.completing) for row in range(shape.rows)]
        result = run_prefill(model, chunks, [new_cache() for _ in chunks], max_rows, vocab_size, split)
        outputs = [cache_arrays(cache) for cache in result.caches]
        mx.eval(outputs if result.last_logits is None else [*outputs, result.last_logits])
        done += 1
    log.info("prefill warm-up: %d shapes in %.1f s", done, time.monotonic() - started)
    return done


def warm_up_model(
    model: Any, config: EngineConfig, kv_quantization: KVQuantization | None, pad_prefill_shapes: bool,
    vocab_size: int, split: HeadSplit | None,
) -> None:
    """Build kernels before the first request: one tiny forward, and every padded prefill shape."""
    logits = model(mx.array([[0, 1]], mx.uint32), cache=new_request_cache(model, kv_quantization))
    mx.eval(logits)
    if pad_prefill_shapes:
        shapes = warmup_shapes(config.max_prefill_seqs, config.prefill_token_budget, config.prefill_chunk_limit,
                               head_split=split is not None)
        warm_prefill_shapes(model, shapes, lambda: new_request_cache(model), config.prefill_warmup_seconds,
                            vocab_size, config.max_prefill_seqs, split)
