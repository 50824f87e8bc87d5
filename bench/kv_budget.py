"""Memory-bound serving in process: N streams whose KV together is far over the engine's KV budget (issue 31).

    python -m bench.kv_budget --random-shape llama-3.1-8b --weight-bits 4 --streams 64 --prompt-tokens 8192 \
        --gen-tokens 128 --fits 16 [--json out.json]

The budget (`kv_budget_bytes`) holds `--fits` requests of this size at the engine's own bytes per token and
allocation step; all N greedy requests are submitted at once and run to completion. Reports whether every one
finished with all its tokens, the errors (none expected: preempted requests resume), the engine's preemptions,
its peak planned KV and the runner's peak measured KV against the budget, MLX's peak memory, and throughput.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import mlx.core as mx

from bench.engine_throughput import engine_core, greedy_request, load_orchard_model, warm_up
from bench.random_model import make_random_model

def run(loaded, args: argparse.Namespace) -> dict:
    probe = engine_core(loaded, kv_budget_bytes=1 << 40)
    # What one request's KV takes as the engine counts it (its bytes per token and allocation step).
    per_token = probe.kv_budget.bytes_per_token
    budget = args.fits * probe.kv_budget.bytes_of([args.prompt_tokens + args.gen_tokens], [])
    probe.close()
    core = engine_core(loaded, max_num_seqs=args.streams, max_decode_seqs=args.streams, kv_budget_bytes=budget,
                       enable_prefix_cache=not args.no_prefix_cache, queue_size=None)
    warm_up(core)
    rng = random.Random(0)
    for i in range(args.streams):
        prompt = [rng.randrange(100, loaded.vocab_size - 3) for _ in range(args.prompt_tokens)]
        core.add_request(core.limits.validate(greedy_request(f"r{i}", prompt, args.gen_tokens)))
    mx.reset_peak_memory()
    tokens: dict[str, int] = {}
    errors, peak_kv, started = [], 0, time.perf_counter()
    while core.has_unfinished_requests():
        for output in core.step():
            tokens[output.request_id] = tokens.get(output.request_id, 0) + len(output.new_token_ids)
            if output.error is not None:
                errors.append(repr(output.error)[:200])
        peak_kv = max(peak_kv, core.runner.kv_cache_bytes())
    wall = time.perf_counter() - started
    stats = core.stats()
    return {
        "streams": args.streams, "prompt_tokens": args.prompt_tokens, "gen_tokens": args.gen_tokens,
        "fits": args.fits, "kv_bytes_per_token": per_token, "kv_budget_bytes": budget,
        "complete": len(tokens) == args.streams and all(n == args.gen_tokens for n in tokens.values()),
        "errors": errors, "preemptions": stats.num_preemptions,
        "peak_measured_kv_bytes": peak_kv, "peak_planned_kv_bytes": core.scheduler.kv_peak_planned_bytes,
        "mlx_peak_memory_bytes": mx.get_peak_memory(), "wall_s": round(wall, 2),
        "generated_tok_s": round(sum(tokens.values()) / wall, 1),
        "prompt_tok_s": round(stats.prompt_tokens_total / wall, 1),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="an mlx-lm model folder (else a random --random-shape one)")
    parser.add_argument("--random-shape", default="qwen3-0.6b", help="bench.random_model's shapes")
    parser.add_argument("--weight-bits", type=int, default=None)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=8192)
    parser.add_argument("--gen-tokens", type=int, default=128)
    parser.add_argument("--fits", type=int, default=16, help="the budget holds this many requests at once")
    parser.add_argument("--no-prefix-cache", action="store_true")
    parser.add_argument("--out", default="/tmp/kv_budget_model")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    path = args.model or make_random_model(args.out, args.random_shape, "bfloat16", args.weight_bits, 0)
    result = run(load_orchard_model(str(path)), args)
    print(json.dumps(result, indent=1), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
