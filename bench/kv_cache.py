"""The engine's KV cache in process: quantized KV and the KV budget (issue 31), and the prefix cache.

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

The prefix cache (formerly bench/prefix_cache.py): TTFT of a hit vs a miss, and memory under prompt churn.

    python -m bench.kv_cache ttft --random-shape qwen3-0.6b --prefix-tokens 2048 --json out.json
    python -m bench.kv_cache shared --random-shape llama-3.1-8b --bits 4 --concurrency 1,8,32
    python -m bench.kv_cache churn --random-shape tiny --prompts 1000 --prompt-tokens 1024 --budget-mb 64

`ttft`: each round sends a 2,048-token shared prefix with a new short suffix; round 0 misses
(cold cache), later rounds hit. `shared` (cache on and off alternately, per concurrency level): one
request with a shared prefix, then N at once with that prefix and distinct suffixes (agents sharing
a system prompt); a first such wave on another prefix builds the shapes and is not counted.
`churn`: distinct prompts one after another; records the cache's bytes, MLX active memory and
process RSS every few prompts.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

import mlx.core as mx

from bench.engine_throughput import engine_core, git_commit, greedy_request, load_orchard_model, machine_info, warm_up
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


@dataclass
class TtftResult:
    prefix_tokens: int
    suffix_tokens: int
    miss_ttft_s: list[float] = field(default_factory=list)
    hit_ttft_s: list[float] = field(default_factory=list)
    hit_cached_tokens: list[int] = field(default_factory=list)

    @property
    def speedup(self) -> float:
        return statistics.median(self.miss_ttft_s) / statistics.median(self.hit_ttft_s)


@dataclass
class ChurnSample:
    prompts_done: int
    cache_bytes: int
    mlx_active_bytes: int
    rss_max_bytes: int


def p95_nearest_rank(values: list[float]) -> float:
    """The 95th percentile as one of the values (nearest rank): the wave's P95 request, not an interpolation."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def _time_to_first_token(core, request) -> tuple[float, int]:
    started = time.perf_counter()
    core.add_request(request)
    first, cached = None, 0
    while core.has_unfinished_requests():
        for output in core.step():
            if first is None and output.new_token_ids:
                first = time.perf_counter() - started
            if output.finish is not None:
                cached = output.finish.usage.cached_tokens
    return first, cached


def run_ttft(loaded, args) -> TtftResult:
    rng = random.Random(0)
    vocab = loaded.vocab_size - 16
    result = TtftResult(args.prefix_tokens, args.suffix_tokens)
    for trial in range(args.trials + 1):  # trial 0 warms kernels up and is not counted
        core = engine_core(loaded, prefix_cache_bytes=4 << 30)
        prefix = [rng.randrange(vocab) for _ in range(args.prefix_tokens)]
        for round_ in range(args.rounds):
            suffix = [rng.randrange(vocab) for _ in range(args.suffix_tokens)]
            ttft, cached = _time_to_first_token(core, greedy_request(f"t{trial}-{round_}", prefix + suffix, 2))
            if trial == 0:
                continue
            if round_ == 0:
                result.miss_ttft_s.append(ttft)
            else:
                result.hit_ttft_s.append(ttft)
                result.hit_cached_tokens.append(cached)
        core.close()
    return result


@dataclass
class SharedWave:
    cache: str
    concurrency: int
    ttft_mean_ms: float
    ttft_p95_ms: float
    wall_ms: float
    gen_tok_s: float
    cached_tokens: int


def _wave(core, prompts: list[list[int]], gen_tokens: int) -> tuple[list[float], float, int]:
    """Submit all prompts at once; their TTFTs, the wall time until all finished, cached tokens in all."""
    requests = [greedy_request(f"w{random.random()}", prompt, gen_tokens) for prompt in prompts]
    ids = [r.request_id for r in requests]
    started = time.perf_counter()
    for request in requests:
        core.add_request(request)
    first: dict[str, float] = {}
    cached = 0
    while core.has_unfinished_requests():
        for output in core.step():
            if output.request_id not in first and output.new_token_ids:
                first[output.request_id] = time.perf_counter() - started
            if output.finish is not None:
                cached += output.finish.usage.cached_tokens
    return [first[i] for i in ids], time.perf_counter() - started, cached


def run_shared(loaded, args) -> list[SharedWave]:
    rng = random.Random(2)
    vocab = loaded.vocab_size - 16
    tokens = lambda n: [rng.randrange(vocab) for _ in range(n)]  # noqa: E731
    waves = []
    for concurrency in [int(c) for c in args.concurrency.split(",")]:
        for cache in ("on", "off"):
            core = engine_core(loaded, enable_prefix_cache=cache == "on", prefix_cache_bytes=4 << 30,
                               max_decode_seqs=max(32, concurrency))
            for _ in range(2):  # the first wave builds this level's shapes; the second is kept
                prefix = tokens(args.prefix_tokens)
                _wave(core, [prefix + tokens(args.suffix_tokens)], args.gen_tokens)  # the prefix, seen once
                ttft, wall, cached = _wave(
                    core, [prefix + tokens(args.suffix_tokens) for _ in range(concurrency)], args.gen_tokens)
            ttft.sort()
            waves.append(SharedWave(cache, concurrency, round(1e3 * statistics.mean(ttft), 1),
                                    round(1e3 * p95_nearest_rank(ttft), 1),
                                    round(1e3 * wall, 1), round(concurrency * args.gen_tokens / wall, 1), cached))
            print(waves[-1])
            core.close()
    return waves


def run_churn(loaded, args) -> list[ChurnSample]:
    rng = random.Random(1)
    vocab = loaded.vocab_size - 16
    core = engine_core(loaded, prefix_cache_bytes=args.budget_mb << 20, max_decode_seqs=8)
    samples = []
    for index in range(args.prompts):
        prompt = [rng.randrange(vocab) for _ in range(args.prompt_tokens)]
        core.add_request(greedy_request(f"c{index}", prompt, 1))
        while core.has_unfinished_requests():
            core.step()
        if index % args.sample_every == 0 or index == args.prompts - 1:
            stats = core.runner.prefix_cache.stats
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            samples.append(ChurnSample(index + 1, stats.bytes_used, mx.get_active_memory(), rss))
    core.runner.prefix_cache.check_integrity()
    return samples


def prefix_main(mode: str, parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """ttft, shared, churn: the prefix cache (each a mode of its own on the command line)."""
    parser.add_argument("--model")
    parser.add_argument("--random-shape", default="tiny")
    parser.add_argument("--bits", type=int, default=None, help="quantize the random model (group 64)")
    parser.add_argument("--prefix-tokens", type=int, default=2048)
    parser.add_argument("--suffix-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=1000)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--budget-mb", type=int, default=64)
    parser.add_argument("--sample-every", type=int, default=50)
    parser.add_argument("--concurrency", default="1,8,32", help="shared: requests per wave")
    parser.add_argument("--gen-tokens", type=int, default=32, help="shared: new tokens per request")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    args.mode = mode
    path = args.model or str(make_random_model(
        tempfile.mkdtemp(prefix="orchard-pc-"), shape=args.random_shape, quantize_bits=args.bits))
    loaded = load_orchard_model(path)
    report = {"mode": args.mode, "settings": vars(args), "machine": machine_info(), "commit": git_commit()}
    if args.mode == "ttft":
        result = run_ttft(loaded, args)
        report["result"] = asdict(result) | {"speedup_median": result.speedup}
        print(f"miss TTFT median {statistics.median(result.miss_ttft_s) * 1e3:.1f} ms, "
              f"hit TTFT median {statistics.median(result.hit_ttft_s) * 1e3:.1f} ms, "
              f"speedup {result.speedup:.1f}x, cached tokens per hit {result.hit_cached_tokens[:3]}")
    elif args.mode == "shared":
        report["waves"] = [asdict(w) for w in run_shared(loaded, args)]
    else:
        samples = run_churn(loaded, args)
        report["samples"] = [asdict(s) for s in samples]
        for s in samples:
            print(f"{s.prompts_done:5d} prompts  cache {s.cache_bytes / 2**20:7.1f} MiB  "
                  f"MLX active {s.mlx_active_bytes / 2**20:8.1f} MiB  RSS max {s.rss_max_bytes / 2**20:8.1f} MiB")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=1)


MODES = {"quant": quant_main, "budget": budget_main, "ttft": lambda p, a: prefix_main("ttft", p, a),
         "shared": lambda p, a: prefix_main("shared", p, a), "churn": lambda p, a: prefix_main("churn", p, a)}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in MODES:
        raise SystemExit(f"usage: python -m bench.kv_cache {{{','.join(MODES)}}} [--help | options]")
    parser = argparse.ArgumentParser(prog=f"bench.kv_cache {argv[0]}", description=__doc__.splitlines()[0])
    MODES[argv[0]](parser, argv[1:])


if __name__ == "__main__":
    main()
