"""The engine's KV cache in process (issue 31), two modes:

    python -m bench.kv_cache quant --random-shape qwen3-0.6b --streams 32 --prompt-tokens 1024 --gen-tokens 128 \
        --kv-bits none,8,4 [--weight-bits 4] [--json out.json]
    python -m bench.kv_cache budget --random-shape llama-3.1-8b --weight-bits 4 --streams 64 --prompt-tokens 8192 \
        --gen-tokens 128 --fits 16 [--kv-bits none,8] [--json out.json]

quant: decode throughput and KV bytes with a quantized KV cache (kv_bits) against unquantized KV. Each setting: one
EngineCore (prefix cache off), N greedy requests of random prompts submitted at once; the decode rate is measured
over the steps after every prompt has been prefilled; KV bytes are the engine's own count (EngineStats.kv_cache_bytes)
at the end of prefill. Greedy tokens are compared with the unquantized run's.

budget: memory-bound serving, N streams whose KV together is far over the engine's KV budget. The budget
(`kv_budget_bytes`) holds `--fits` requests of this size at the engine's own bytes per token and allocation step with
unquantized KV; all N greedy requests are submitted at once and run to completion, once per `--kv-bits` setting
against that same budget. Reports whether every one finished with all its tokens, the errors (none expected:
preempted requests resume), the engine's preemptions, the most requests running at once, its peak planned KV and the
runner's peak measured KV against the budget, MLX's peak memory, and throughput. A quantized KV cache (Apple silicon,
CPU) holds more requests in the same budget.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

import mlx.core as mx

from bench.engine_throughput import engine_core, greedy_request, load_orchard_model, warm_up
from tests.support.random_model import make_random_model


def add_model_arguments(parser: argparse.ArgumentParser, out: str, shape_help: str) -> None:
    """The model a KV bench runs (kv_quant, kv_budget): a folder, else a random one of --random-shape."""
    parser.add_argument("--model", default=None, help="an mlx-lm model folder (else a random --random-shape one)")
    parser.add_argument("--random-shape", default="qwen3-0.6b", help=shape_help)
    parser.add_argument("--weight-bits", type=int, default=None)
    parser.add_argument("--out", default=out, help="where the random model is written")


def load_bench_model(args: argparse.Namespace):
    path = args.model or make_random_model(args.out, args.random_shape, "bfloat16", args.weight_bits, 0)
    return load_orchard_model(str(path))


def kv_bits_settings(text: str) -> list[int | None]:
    """--kv-bits "none,8,4" as engine kv_bits values (None: unquantized)."""
    return [None if setting == "none" else int(setting) for setting in text.split(",")]


def run_quant(loaded, kv_bits: int | None, prompts: list[list[int]], gen_tokens: int) -> dict:
    core = engine_core(loaded, max_decode_seqs=len(prompts), max_num_seqs=len(prompts), enable_prefix_cache=False,
                       kv_bits=kv_bits, queue_size=None)
    warm_up(core)
    for i, prompt in enumerate(prompts):
        core.add_request(core.limits.validate(greedy_request(f"r{i}", prompt, gen_tokens)))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    started = time.perf_counter()
    decode_start = kv_bytes = None
    decoded = 0
    while core.has_unfinished_requests():
        outputs = core.step()
        for output in outputs:
            tokens[output.request_id].extend(output.new_token_ids)
        if decode_start is None and all(tokens.values()):
            decode_start, kv_bytes = time.perf_counter(), core.stats().kv_cache_bytes
        elif decode_start is not None:
            decoded += sum(len(o.new_token_ids) for o in outputs)
    end = time.perf_counter()
    return {
        "kv_bits": kv_bits, "streams": len(prompts), "total_s": round(end - started, 2),
        "decode_tok_s": round(decoded / (end - decode_start), 1), "kv_bytes_after_prefill": kv_bytes,
        "tokens": [tokens[f"r{i}"] for i in range(len(prompts))],
    }


def budget_for(loaded, args: argparse.Namespace) -> int:
    """What `--fits` requests' KV takes as the engine counts it (unquantized bytes per token, allocation step)."""
    probe = engine_core(loaded, kv_budget_bytes=1 << 40)
    budget = args.fits * probe.kv_budget.bytes_of([args.prompt_tokens + args.gen_tokens], [])
    probe.close()
    return budget


def run_budget(loaded, args: argparse.Namespace, budget: int, kv_bits: int | None = None) -> dict:
    core = engine_core(loaded, max_num_seqs=args.streams, max_decode_seqs=args.streams, kv_budget_bytes=budget,
                       enable_prefix_cache=not args.no_prefix_cache, queue_size=None, kv_bits=kv_bits)
    warm_up(core)
    rng = random.Random(0)
    for i in range(args.streams):
        prompt = [rng.randrange(100, loaded.vocab_size - 3) for _ in range(args.prompt_tokens)]
        core.add_request(core.limits.validate(greedy_request(f"r{i}", prompt, args.gen_tokens)))
    mx.reset_peak_memory()
    tokens: dict[str, int] = {}
    errors, peak_kv, most_running, started = [], 0, 0, time.perf_counter()
    while core.has_unfinished_requests():
        for output in core.step():
            tokens[output.request_id] = tokens.get(output.request_id, 0) + len(output.new_token_ids)
            if output.error is not None:
                errors.append(repr(output.error)[:200])
        peak_kv = max(peak_kv, core.runner.kv_cache_bytes())
        most_running = max(most_running, len(core.scheduler.running))
    wall = time.perf_counter() - started
    stats = core.stats()
    core.close()
    return {
        "kv_bits": kv_bits, "streams": args.streams, "prompt_tokens": args.prompt_tokens, "gen_tokens": args.gen_tokens,
        "fits": args.fits, "kv_bytes_per_token": stats.kv_bytes_per_token, "kv_budget_bytes": budget,
        "complete": len(tokens) == args.streams and all(n == args.gen_tokens for n in tokens.values()),
        "errors": errors, "preemptions": stats.num_preemptions, "most_running_at_once": most_running,
        "peak_measured_kv_bytes": peak_kv, "peak_planned_kv_bytes": core.scheduler.kv_peak_planned_bytes,
        "mlx_peak_memory_bytes": mx.get_peak_memory(), "wall_s": round(wall, 2),
        "generated_tok_s": round(sum(tokens.values()) / wall, 1),
        "prompt_tok_s": round(stats.prompt_tokens_total / wall, 1),
    }


def quant_main(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    add_model_arguments(parser, "/tmp/kv_quant_model", "tests.support.random_model's shapes (head_dim >= 32)")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--gen-tokens", type=int, default=128)
    parser.add_argument("--kv-bits", default="none,8,4")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    loaded = load_bench_model(args)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, loaded.vocab_size - 3) for _ in range(args.prompt_tokens)] for _ in range(args.streams)]
    results = []
    for kv_bits in kv_bits_settings(args.kv_bits):
        result = run_quant(loaded, kv_bits, prompts, args.gen_tokens)
        if results:
            base = results[0]["tokens"]
            same = sum(a == b for x, y in zip(base, result["tokens"]) for a, b in zip(x, y))
            result["tokens_equal_to_first_setting"] = round(same / sum(len(x) for x in base), 3)
        results.append(result)
        print(json.dumps({k: v for k, v in result.items() if k != "tokens"}), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: v for k, v in r.items() if k != "tokens"} for r in results], f, indent=1)


def budget_main(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    add_model_arguments(parser, "/tmp/kv_budget_model", "tests.support.random_model's shapes")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=8192)
    parser.add_argument("--gen-tokens", type=int, default=128)
    parser.add_argument("--fits", type=int, default=16, help="the budget holds this many requests at once")
    parser.add_argument("--no-prefix-cache", action="store_true")
    parser.add_argument("--kv-bits", default="none", help="comma-separated: none, 8, 4 (each run against the same budget)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    loaded = load_bench_model(args)
    budget = budget_for(loaded, args)
    results = []
    for kv_bits in kv_bits_settings(args.kv_bits):
        results.append(run_budget(loaded, args, budget, kv_bits))
        print(json.dumps(results[-1], indent=1), flush=True)
    if len(results) > 1:
        first = results[0]["most_running_at_once"]
        for result in results[1:]:
            print(f"kv_bits {result['kv_bits']}: {result['most_running_at_once']} requests at once against "
                  f"{first} ({result['most_running_at_once'] / first:.2f}x) in the same budget", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results[0] if len(results) == 1 else results, f, indent=1)


MODES = {"quant": quant_main, "budget": budget_main}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in MODES:
        raise SystemExit(f"usage: python -m bench.kv_cache {{{','.join(MODES)}}} [--help | options]")
    parser = argparse.ArgumentParser(prog=f"bench.kv_cache {argv[0]}", description=__doc__.splitlines()[0])
    MODES[argv[0]](parser, argv[1:])


if __name__ == "__main__":
    main()
