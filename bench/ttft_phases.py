"""Diagnostic: where a prefix-cache hit's time to first token goes, phase by phase (in process).

    python -m bench.ttft_phases --random-shape qwen3-0.6b
Each phase is closed with mx.eval so device time is attributed to the phase that queued it.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

import mlx.core as mx

from bench.random_model import make_random_model
from engine import EngineConfig, EngineCore, Request, SamplingParams
from engine.kv.batch_cache import cache_arrays, new_request_cache
from engine.runner.loader import load_model
from engine.runner.prefill import run_prefill
from engine.scheduler.output import PrefillChunk


def _ms(start: float) -> str:
    return f"{1e3 * (time.perf_counter() - start):7.2f}"


def run_to_first_token(core: EngineCore, request: Request) -> float:
    started = time.perf_counter()
    core.add_request(request)
    while True:
        if any(o.new_token_ids for o in core.step()):
            ttft = time.perf_counter() - started
            while core.has_unfinished_requests():
                core.step()
            return ttft


def hit_phases(core: EngineCore, prefix: list[int], suffix: list[int]) -> None:
    runner, scheduler = core.runner, core.scheduler
    request = Request(f"p{random.random()}", prefix + suffix, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    t = time.perf_counter(); core.add_request(request); add = _ms(t)
    t = time.perf_counter(); scheduled = scheduler.schedule(); sched = _ms(t)
    with mx.stream(runner.stream):
        t = time.perf_counter(); cache = runner._request_cache(request); build = _ms(t)
        mx.eval(cache_arrays(cache)); assemble = _ms(t)
        chunk = scheduled.prefill_chunks[0]
        t = time.perf_counter(); result = run_prefill(runner.model, [chunk], [cache], None, runner.batch.vocab_size); graph = _ms(t)
        mx.eval(result.last_logits, cache_arrays(result.caches[0])); forward = _ms(t)
    print(f"hit phases ms: add {add} schedule {sched} cache-graph {build} cache-eval {assemble} "
          f"prefill-graph {graph} prefill-eval {forward}")
    core.abort_request(request.request_id)
    while core.has_unfinished_requests():
        core.step()


def plain_forwards(loaded, prefix: list[int], suffix: list[int]) -> None:
    model = loaded.model
    cache = new_request_cache(model)
    for start in range(0, len(prefix), 2048):
        model(mx.array([prefix[start:start + 2048]], mx.uint32), cache=cache)
        mx.eval(cache_arrays(cache))
    for n in (16, 8, 4, 2, 1):
        for _ in range(3):
            t = time.perf_counter()
            logits = model(mx.array([suffix[:n]], mx.uint32), cache=cache)[:, -1, :]
            mx.eval(logits)
            print(f"mlx-lm cache, {n}-token forward on {cache[0].offset - n} cached: {_ms(t)} ms")
    t = time.perf_counter()
    cache2 = new_request_cache(model)
    model(mx.array([prefix[:2048]], mx.uint32), cache=cache2)
    mx.eval(cache_arrays(cache2))
    print(f"2048-token prefill (no logits): {_ms(t)} ms")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--random-shape", default="tiny")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--bits", type=int, default=None, help="quantize the random model (group 64)")
    args = parser.parse_args()
    loaded = load_model(str(make_random_model(tempfile.mkdtemp(prefix="orchard-tp-"), args.random_shape, args.dtype, args.bits)))
    rng = random.Random(0)
    vocab = loaded.vocab_size - 16
    prefix = [rng.randrange(vocab) for _ in range(2048)]
    core = EngineCore(loaded, EngineConfig(prefix_cache_bytes=4 << 30))
    for i in range(8):
        suffix = [rng.randrange(vocab) for _ in range(16)]
        ttft = run_to_first_token(core, Request(f"r{i}", prefix + suffix, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)))
        print(f"same core, request {i}: TTFT {1e3 * ttft:.2f} ms")
    for _ in range(3):
        hit_phases(core, prefix, [rng.randrange(vocab) for _ in range(16)])
    plain_forwards(loaded, prefix, [rng.randrange(vocab) for _ in range(16)])
    single = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    core.add_request(Request("decode", prefix[:128], single))
    steps = []
    while core.has_unfinished_requests():
        t = time.perf_counter(); core.step(); steps.append(time.perf_counter() - t)
    steps.sort()
    print(f"lone decode step: median {1e3 * steps[len(steps) // 2]:.2f} ms")


if __name__ == "__main__":
    main()
