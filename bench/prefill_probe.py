"""Diagnostic: what a batched prefill of N equal prompts costs, path by path (in process, warm).

    python -m bench.prefill_probe --random-shape qwen3-0.6b --rows 1,8,16,32 --tokens 512 --json out.json

Paths, each timed cold (first use of the shape) and warm (median of --repeat):
  engine      engine.runner.prefill.run_prefill as the runner calls it (padded shapes on a GPU)
  raw_body    one mlx-lm forward [N, tokens] into a fresh cache, the KV evaluated (no lm_head)
  raw_logits  the same forward with its last positions' logits evaluated (the full lm_head is computed)
A burst of N prompts cannot get its first tokens sooner than raw_body allows on this backend.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from bench.engine_throughput import machine_info
from bench.random_model import make_random_model
from engine import Request, SamplingParams
from engine.kv.batch_cache import cache_arrays, new_request_cache
from engine.runner.loader import load_model
from engine.runner.prefill import run_prefill
from engine.scheduler.output import PrefillChunk


def timed(fn: Callable[[], None], repeat: int) -> tuple[float, float]:
    """(cold ms, warm median ms)."""
    times = []
    for _ in range(1 + repeat):
        started = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - started))
    return round(times[0], 2), round(statistics.median(times[1:]), 2)


def engine_path(model, prompts: list[list[int]], pad: bool, vocab: int) -> Callable[[], None]:
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def run() -> None:
        requests = [Request(f"p{i}", p, params) for i, p in enumerate(prompts)]
        chunks = [PrefillChunk(r, 0, len(r.prompt_token_ids)) for r in requests]
        caches = [new_request_cache(model) for _ in chunks]
        result = run_prefill(model, chunks, caches, len(chunks) if pad else None, vocab)
        mx.eval(result.last_logits, *(cache_arrays(c) for c in result.caches))

    return run


def raw_path(model, prompts: list[list[int]], with_logits: bool) -> Callable[[], None]:
    tokens = mx.array(prompts, mx.uint32)

    def run() -> None:
        cache = make_prompt_cache(model)
        logits = model(tokens, cache=cache)
        arrays = [a for c in cache for a in c.state]
        mx.eval(logits[:, -1, :], *arrays) if with_logits else mx.eval(*arrays)

    return run


def probe(model, rows: int, num_tokens: int, repeat: int, vocab: int, pad: bool) -> dict:
    prompts = [[(7 + 31 * r + 13 * i) % (vocab - 16) for i in range(num_tokens)] for r in range(rows)]
    out = {"rows": rows, "tokens": num_tokens}
    out["engine"] = timed(engine_path(model, prompts, pad, vocab), repeat)
    out["raw_body"] = timed(raw_path(model, prompts, False), repeat)
    out["raw_logits"] = timed(raw_path(model, prompts, True), repeat)
    mx.clear_cache()
    return out


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--random-shape", default="qwen3-0.6b")
    p.add_argument("--bits", type=int, default=None)
    p.add_argument("--rows", default="1,8,16,32")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="orchard-pp-") as tmp:
        path = make_random_model(Path(tmp) / "model", args.random_shape, quantize_bits=args.bits)
        loaded = load_model(str(path))
        pad = mx.default_device().type == mx.gpu
        results = []
        with mx.stream(mx.new_stream(mx.default_device())):
            for rows in (int(r) for r in args.rows.split(",")):
                row = probe(loaded.model, rows, args.tokens, args.repeat, loaded.vocab_size, pad)
                results.append(row)
                print("  ".join(f"{k} {v}" for k, v in row.items()), flush=True)
    report = {"machine": machine_info(), "shape": args.random_shape, "bits": args.bits, "pad_shapes": pad,
              "cells": "[cold ms, warm median ms]", "results": results}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
