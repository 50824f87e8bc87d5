"""The in-process engine rate for bench.compare: bench.engine_throughput's orchard column, JSON after every level.

    python -m bench.engine_baseline --model PATH --levels 1,8,64 --prompt-tokens 128 --gen-tokens 128 \
        --stagger-ms 1 --json out.json

Requests arrive as the HTTP load generator sends a wave (one every --stagger-ms), so that
"HTTP tok/s / in-process tok/s" compares the same arrival pattern; `at_once_tok_per_s` is
engine_throughput's all-at-once figure. Run as a child process so its MLX memory is gone
before or after the servers run, and so a time limit can stop it while the levels already
measured stay in the JSON.

With --on-demand it loads the model, prints READY_LINE and then runs one level per line read on stdin (a
concurrency), printing ROUND_PREFIX + the level's JSON: bench.efficiency_rounds alternates these with the same
level over HTTP, so that both rates come from the same minutes of a machine whose speed drifts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import mlx.core as mx

from bench.engine_throughput import OrchardRunner, Trace, free_memory, step_into, machine_info, make_prompts, model_info, summarize
from engine.config import EngineConfig

READY_LINE = "ENGINE READY"
ROUND_PREFIX = "ROUND "


class StaggeredOrchardRunner(OrchardRunner):
    """Our EngineCore, request i added `i * stagger_s` after the start (0: all at once, as engine_throughput)."""

    stagger_s = 0.0
    # The last run's mean wall and engine-thread CPU milliseconds per engine step.
    step_ms_mean = 0.0
    step_cpu_ms_mean = 0.0

    def run(self, prompts: list[list[int]], gen_tokens: int) -> Trace:
        from engine import Request, SamplingParams

        core = self._core_for(len(prompts))
        params = SamplingParams(max_tokens=gen_tokens, temperature=0.0, ignore_eos=True)
        trace = Trace(start=time.perf_counter())
        arrivals = [trace.start + i * self.stagger_s for i in range(len(prompts))]
        submitted = 0
        before = core.stats()
        while submitted < len(prompts) or core.has_unfinished_requests():
            now = time.perf_counter()
            while submitted < len(prompts) and arrivals[submitted] <= now:
                request_id = f"r{self._next_id}"
                self._next_id += 1
                core.add_request(Request(request_id=request_id, prompt_token_ids=prompts[submitted], sampling=params))
                submitted += 1
            if not core.has_unfinished_requests():
                time.sleep(max(0.0, arrivals[submitted] - time.perf_counter()))
                continue
            step_into(core, trace)
        trace.end = time.perf_counter()
        after = core.stats()
        steps = max(1, after.num_steps - before.num_steps)
        self.step_ms_mean = 1e3 * (after.step_seconds_total - before.step_seconds_total) / steps
        self.step_cpu_ms_mean = 1e3 * (after.step_cpu_seconds_total - before.step_cpu_seconds_total) / steps
        return trace


def bench_level(runner: StaggeredOrchardRunner, concurrency: int, args, vocab_size: int, warm_up: bool = True) -> dict:
    """Warm-up at this level, then the staggered run and the all-at-once run on the same prompts' shapes."""
    if warm_up:
        runner.stagger_s = 0.0
        warm = make_prompts(concurrency, args.prompt_tokens, vocab_size, [args.seed, concurrency, 1])
        # Full-length warm-up: every KV length the timed runs reach has been seen (the HTTP `uniform` sweep runs
        # after `mixed` has decoded as far at every level).
        runner.run(warm, args.warmup_tokens or args.gen_tokens)
        free_memory()
    timed, steps_ms = {}, {}
    for name, stagger_ms, seed_tag in (("staggered", args.stagger_ms, 0), ("at_once", 0.0, 2)):
        runner.stagger_s = stagger_ms / 1e3
        prompts = make_prompts(concurrency, args.prompt_tokens, vocab_size, [args.seed, concurrency, seed_tag])
        mx.reset_peak_memory()
        result = summarize(runner.name, concurrency, args.prompt_tokens, args.gen_tokens, runner.run(prompts, args.gen_tokens))
        result.peak_memory_gb = mx.get_peak_memory() / 1e9
        timed[name] = result
        steps_ms[name] = (round(runner.step_ms_mean, 3), round(runner.step_cpu_ms_mean, 3))
        free_memory()
    record = asdict(timed["staggered"])
    record.update(stagger_ms=args.stagger_ms, at_once_tok_per_s=timed["at_once"].tok_per_s,
                  at_once_complete=timed["at_once"].complete, step_ms_mean=steps_ms["staggered"][0],
                  step_cpu_ms_mean=steps_ms["staggered"][1])
    return record


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--levels", default="1,8,32,64,128")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--warmup-tokens", type=int, default=0, help="0: as many as --gen-tokens")
    p.add_argument("--stagger-ms", type=float, default=1.0, help="between request arrivals, as the HTTP client")
    p.add_argument("--prefill-batch-size", type=int, default=EngineConfig.max_prefill_seqs)
    p.add_argument("--prefill-chunk-tokens", type=int, default=2048)
    p.add_argument("--prefix-cache", choices=["on", "off"], default="on", help="as the server runs (on by default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--on-demand", action="store_true", help="levels from stdin, one per line; results on stdout")
    p.add_argument("--json", required=True)
    return p.parse_args(argv)


def _write(path: Path, report: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=2))
    tmp.replace(path)


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    levels = [int(x) for x in args.levels.split(",") if x.strip()]
    path = Path(args.json)
    info = model_info(args.model, None)
    report = {"machine": machine_info(), "model": info, "settings": vars(args), "results": [], "error": None}
    _write(path, report)
    started = time.perf_counter()
    runner = StaggeredOrchardRunner(args.model, args.prefill_batch_size, args.prefill_chunk_tokens, args.prefix_cache == "on")
    print(f"[engine] loaded in {time.perf_counter() - started:.1f} s", flush=True)
    if args.on_demand:
        try:
            serve_rounds(runner, args, info["vocab_size"])
        finally:
            runner.close()
            free_memory()
        return
    try:
        for concurrency in levels:
            record = bench_level(runner, concurrency, args, info["vocab_size"])
            report["results"].append(record)
            _write(path, report)
            print(f"  [engine] c={concurrency:<4} {record['tok_per_s']:9.1f} tok/s ({args.stagger_ms:g} ms apart), "
                  f"{record['at_once_tok_per_s']:9.1f} all at once  complete {record['complete']}  "
                  f"{record['step_ms_mean']:.2f} ms/step (thread CPU {record['step_cpu_ms_mean']:.2f})", flush=True)
    except Exception as exc:  # the levels measured so far stay in the JSON
        traceback.print_exc()
        report["error"] = f"{type(exc).__name__}: {exc}"
        _write(path, report)
    finally:
        runner.close()
        free_memory()


def serve_rounds(runner: StaggeredOrchardRunner, args: argparse.Namespace, vocab_size: int) -> None:
    """One level per stdin line until it closes; each level warms up the first time it is asked for."""
    warmed: set[int] = set()
    print(READY_LINE, flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        concurrency = int(line)
        record = bench_level(runner, concurrency, args, vocab_size, warm_up=concurrency not in warmed)
        warmed.add(concurrency)
        print(ROUND_PREFIX + json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
