"""Prefix cache figures, in process: TTFT of a hit vs a miss, and memory under prompt churn.

    python -m bench.prefix_cache ttft --random-shape qwen3-0.6b --prefix-tokens 2048 --json out.json
    python -m bench.prefix_cache shared --random-shape llama-3.1-8b --bits 4 --concurrency 1,8,32
    python -m bench.prefix_cache churn --random-shape tiny --prompts 1000 --prompt-tokens 1024 --budget-mb 64

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
import tempfile
import time
from dataclasses import asdict, dataclass, field

import mlx.core as mx

from bench.engine_throughput import engine_core, git_commit, greedy_request, load_orchard_model, machine_info
from tests.support.random_model import make_random_model


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["ttft", "shared", "churn"])
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
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
