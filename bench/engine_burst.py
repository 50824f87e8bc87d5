"""In-process burst (no HTTP): TTFT of N prompts added at once vs a lone prompt's, through EngineCore.

    python -m bench.engine_burst --random-shape qwen3-0.6b --burst 32 --prompt-tokens 512 --json out.json

With --stagger-ms S, prompt i arrives i * S ms after the first (bench.serving's burst sends them 2 ms apart)
and its TTFT counts from its own arrival.

Separates the engine's share of bench.serving's burst figure from the HTTP / Ray share. Prints
each step of the burst (prefill tokens, decode rows, milliseconds).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time

from bench.engine_throughput import git_commit, machine_info
from bench.random_model import make_random_model
from engine import EngineConfig, EngineCore, Request, SamplingParams
from engine.runner.loader import load_model


def p95_nearest_rank(values: list[float]) -> float:
    """The 95th percentile as one of the values (nearest rank): the burst's P95 request, not an interpolation."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def burst_requests(prompts: list[list[int]], gen_tokens: int) -> list[Request]:
    """Greedy requests of exactly gen_tokens new tokens each, with fresh ids."""
    sampling = SamplingParams(max_tokens=gen_tokens, temperature=0.0, ignore_eos=True)
    return [Request(f"b{random.random()}", prompt, sampling) for prompt in prompts]


def submit_all(core: EngineCore, prompts: list[list[int]], gen_tokens: int) -> tuple[list[str], float]:
    """Add the prompts at once: their request ids and the start time (bench.prefix_cache's waves)."""
    requests = burst_requests(prompts, gen_tokens)
    started = time.perf_counter()
    for request in requests:
        core.add_request(request)
    return [r.request_id for r in requests], started


def add_arrived(core: EngineCore, pending: list[Request], arrivals: dict[str, float]) -> None:
    """Add the pending requests whose arrival time has come (pending is in arrival order)."""
    now = time.perf_counter()
    while pending and arrivals[pending[0].request_id] <= now:
        core.add_request(pending.pop(0))


def first_token_times(
    core: EngineCore, prompts: list[list[int]], gen_tokens: int, steps: list[dict], stagger_s: float = 0.0
) -> list[float]:
    """Each prompt's TTFT from its own arrival (greedy, exactly gen_tokens each)."""
    pending = burst_requests(prompts, gen_tokens)
    ids, started = [r.request_id for r in pending], time.perf_counter()
    arrivals = {request_id: started + i * stagger_s for i, request_id in enumerate(ids)}
    ttft: dict[str, float] = {}
    while pending or core.has_unfinished_requests():
        add_arrived(core, pending, arrivals)
        if not core.has_unfinished_requests():
            time.sleep(max(0.0, arrivals[pending[0].request_id] - time.perf_counter()))
            continue
        t = time.perf_counter()
        waiting = len(core.scheduler.waiting)
        outputs = core.step()
        now = time.perf_counter()
        steps.append({"ms": round(1e3 * (now - t), 2), "waiting_before": waiting,
                      "first_tokens": sum(1 for o in outputs if o.request_id not in ttft and o.delta)})
        for output in outputs:
            if output.request_id not in ttft and output.delta is not None and output.delta.token_ids:
                ttft[output.request_id] = now - arrivals[output.request_id]
    return [ttft[request_id] for request_id in ids]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--random-shape", default="tiny")
    parser.add_argument("--burst", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--gen-tokens", type=int, default=32)
    parser.add_argument("--stagger-ms", type=float, default=0.0, help="prompt i arrives i * this after the first")
    parser.add_argument("--prefix-cache", choices=["on", "off"], default="on")
    parser.add_argument("--prefill-batch", type=int, default=EngineConfig.max_prefill_seqs, help="max_prefill_seqs")
    parser.add_argument("--step-tokens", type=int, default=EngineConfig.prefill_step_tokens, help="prefill_step_tokens")
    parser.add_argument("--warmup-seconds", type=float, default=EngineConfig.prefill_warmup_seconds, help="prefill_warmup_seconds")
    parser.add_argument("--json")
    args = parser.parse_args()
    loaded = load_model(str(make_random_model(tempfile.mkdtemp(prefix="orchard-eb-"), args.random_shape)))
    config = EngineConfig(max_decode_seqs=128, max_prefill_seqs=args.prefill_batch,
                          prefill_step_tokens=args.step_tokens, prefill_warmup_seconds=args.warmup_seconds,
                          enable_prefix_cache=args.prefix_cache == "on")
    core = EngineCore(loaded, config)
    started = time.perf_counter()
    core.runner.warmup()
    warmup_s = time.perf_counter() - started
    rng = random.Random(0)
    vocab = loaded.vocab_size - 16
    prompt = lambda: [rng.randrange(vocab) for _ in range(args.prompt_tokens)]  # noqa: E731
    first_token_times(core, [prompt() for _ in range(args.burst)], args.gen_tokens, [])  # first-use costs
    lone = [first_token_times(core, [prompt()], args.gen_tokens, [])[0] for _ in range(3)]
    steps: list[dict] = []
    burst = sorted(first_token_times(core, [prompt() for _ in range(args.burst)], args.gen_tokens, steps,
                                     args.stagger_ms / 1e3))
    p95 = p95_nearest_rank(burst)
    report = {
        "commit": git_commit(), "machine": machine_info(), "shape": args.random_shape, "burst": args.burst,
        "prompt_tokens": args.prompt_tokens, "stagger_ms": args.stagger_ms, "prefix_cache": args.prefix_cache,
        "prefill_batch": args.prefill_batch, "step_tokens": args.step_tokens, "warmup_s": round(warmup_s, 1),
        "lone_ttft_ms": round(1e3 * statistics.median(lone), 1), "burst_ttft_p95_ms": round(1e3 * p95, 1),
        "burst_ttft_ms": [round(1e3 * t, 1) for t in burst], "ratio": round(p95 / statistics.median(lone), 2),
        "burst_steps": steps[:40],
    }
    print(json.dumps({k: v for k, v in report.items() if k != "machine"}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
