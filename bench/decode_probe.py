"""Diagnostic: one decode step of N sequences, the engine's against a bare forward + argmax on the same batch.

    python -m bench.decode_probe --random-shape qwen3-0.6b --rows 64 --json out.json

Fills an EngineCore with N greedy requests, steps until all decode, then times --steps engine
steps and as many bare steps (mlx-lm forward on the engine's batched cache, argmax, read back,
no pipelining) with wall and thread-CPU times. engine - bare = the engine's own per-step cost.
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

from bench.engine_throughput import machine_info
from bench.random_model import make_random_model
from engine import EngineConfig, EngineCore, Request, SamplingParams
from engine.runner.loader import load_model


def timed_steps(step: Callable[[], None], steps: int) -> dict:
    walls, cpus = [], []
    for _ in range(steps):
        wall, cpu = time.perf_counter(), time.thread_time()
        step()
        walls.append(1e3 * (time.perf_counter() - wall))
        cpus.append(1e3 * (time.thread_time() - cpu))
    return {"ms_median": round(statistics.median(walls), 3), "cpu_ms_median": round(statistics.median(cpus), 3)}


def probe(loaded, rows: int, prompt_tokens: int, steps: int) -> dict:
    core = EngineCore(loaded, EngineConfig(max_decode_seqs=rows, max_prefill_seqs=8))
    params = SamplingParams(max_tokens=10 * steps + 64, temperature=0.0, ignore_eos=True)
    vocab = loaded.vocab_size - 16
    for i in range(rows):
        core.add_request(Request(f"r{i}", [(i * 7 + j * 13) % vocab for j in range(prompt_tokens)], params))
    while len(core.runner.batch) < rows or core.scheduler.num_waiting:
        core.step()
    for _ in range(5):
        core.step()
    result = {"rows": rows, "engine": timed_steps(core.step, steps)}
    model, caches = loaded.model, core.runner.batch.caches
    state = {"tokens": mx.zeros((rows,), mx.uint32)}

    def bare_step() -> None:
        logits = model(state["tokens"][:, None], cache=caches)[:, -1, :]
        state["tokens"] = mx.argmax(logits, axis=-1).astype(mx.uint32)
        state["tokens"].tolist()

    with mx.stream(core.runner.stream):
        timed_steps(bare_step, 3)
        result["bare"] = timed_steps(bare_step, steps)
    core.close()
    return result


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--random-shape", default="qwen3-0.6b")
    p.add_argument("--rows", default="1,64,128")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="orchard-dp-") as tmp:
        loaded = load_model(str(make_random_model(Path(tmp) / "model", args.random_shape)))
        for rows in (int(r) for r in args.rows.split(",")):
            results.append(probe(loaded, rows, args.prompt_tokens, args.steps))
            print(json.dumps(results[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine_info(), "shape": args.random_shape,
                                               "results": results}, indent=1))


if __name__ == "__main__":
    main()
