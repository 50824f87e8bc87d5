"""The in-process engine rate for bench.serving.compare: bench.engine_throughput's orchard column, JSON after every level.

    python -m bench.serving.engine_baseline --model PATH --levels 1,8,64 --prompt-tokens 128 --gen-tokens 128 \
        --stagger-ms 1 --json out.json

Requests arrive as the HTTP load generator sends a wave (one every --stagger-ms), so that
"HTTP tok/s / in-process tok/s" compares the same arrival pattern; `at_once_tok_per_s` is
engine_throughput's all-at-once figure. compare runs it as a child process, so that its MLX memory
is gone before or after the servers run and a time limit can stop it while the levels already
measured stay in the JSON.

Alternating rounds (compare --efficiency-rounds K): the lent machines drift, so a ratio of two rates
measured minutes apart says as much about the drift as about the HTTP path (an in-process engine ran
14.4 then 18.8 ms steps in two consecutive 64-stream levels of one process: results of commit 0ffeaee).
With --on-demand this module loads the model, prints READY_LINE, then runs one level per line read on
stdin (a concurrency) and prints ROUND_PREFIX + the level's JSON. `alternate` (in compare's process)
runs the same `uniform` level K times over HTTP against the running server and K times in that child,
one after the other: each round's ratio comes from the same minute, and the check takes their median.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import queue
import statistics
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from deployments.cli.loadgen.load import run_suite
from deployments.cli.loadgen.workloads import LoadSettings

READY_LINE = "ENGINE READY"
ROUND_PREFIX = "ROUND "
ENGINE_READY_TIMEOUT_S = 60.0


# ---- the engine child (MLX is imported here only, not in compare's process)
def bench_level(runner: Any, concurrency: int, args: argparse.Namespace, vocab_size: int, warm_up: bool = True) -> dict:
    """Warm-up at this level, then the staggered run and the all-at-once run on the same prompts' shapes."""
    import mlx.core as mx

    from bench.engine_throughput import free_memory, make_prompts, summarize

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
    p.add_argument("--stagger-ms", type=float, default=1.0, help="between request arrivals (compare passes the HTTP client's)")
    p.add_argument("--prefill-batch-size", type=int, default=None, help="default: the engine's")
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
    from bench.engine_throughput import OrchardRunner, free_memory, machine_info, model_info

    args = parse_args(argv)
    levels = [int(x) for x in args.levels.split(",") if x.strip()]
    path = Path(args.json)
    info = model_info(args.model, None)
    report = {"machine": machine_info(), "model": info, "settings": vars(args), "results": [], "error": None}
    _write(path, report)
    started = time.perf_counter()
    runner = OrchardRunner(args.model, args.prefill_batch_size, args.prefill_chunk_tokens, args.prefix_cache == "on")
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


def serve_rounds(runner: Any, args: argparse.Namespace, vocab_size: int) -> None:
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


# ---- alternating rounds, from compare's process
@dataclass
class EfficiencyRound:
    http_tok_s: float
    engine_tok_s: float

    @property
    def ratio(self) -> float:
        return self.http_tok_s / self.engine_tok_s if self.engine_tok_s else float("nan")


@dataclass
class EfficiencyResult:
    level: int
    rounds: list[EfficiencyRound] = field(default_factory=list)
    note: str = ""

    @property
    def median_ratio(self) -> float:
        ratios = [r.ratio for r in self.rounds if r.ratio == r.ratio]
        return statistics.median(ratios) if ratios else float("nan")

    def to_json(self) -> dict[str, Any]:
        rounds = [dict(dataclasses.asdict(r), ratio=round(r.ratio, 4)) for r in self.rounds]
        return {"level": self.level, "rounds": rounds, "median_ratio": round(self.median_ratio, 4), "note": self.note}


class EngineChild:
    """This module with --on-demand in a child process: one level per call, its JSON back."""

    def __init__(self, argv: list[str], cwd: Path, log_path: Path) -> None:
        self._log = log_path.open("w")
        self._process = subprocess.Popen(argv + ["--on-demand"], cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=self._log, text=True, bufsize=1)
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self._process.stdout:
            self._log.write(line)
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)  # the child ended

    def _line_starting(self, prefix: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            line = self._lines.get(timeout=max(0.01, deadline - time.monotonic()))
            if line is None:
                raise RuntimeError(f"the engine child exited ({self._process.wait()}) before '{prefix.strip()}'")
            if line.startswith(prefix):
                return line

    def wait_ready(self, timeout_s: float) -> None:
        self._line_starting(READY_LINE, timeout_s)

    def run_level(self, level: int, timeout_s: float) -> dict[str, Any]:
        self._process.stdin.write(f"{level}\n")
        self._process.stdin.flush()
        return json.loads(self._line_starting(ROUND_PREFIX, timeout_s)[len(ROUND_PREFIX):])

    def close(self) -> None:
        try:
            self._process.stdin.close()
            self._process.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self._process.kill()
        finally:
            self._log.close()


async def http_rate(target: Any, settings: LoadSettings, level: int, deadline: float, warm_up: bool) -> float:
    """System tok/s of one `uniform` round at `level` (the sweep's settings otherwise); warm-up requests first
    only if asked, as the engine child warms a level only the first time."""
    warmup_tokens = settings.warmup_tokens if warm_up else 0
    one_level = dataclasses.replace(settings, workloads=["uniform"], levels=[level], warmup_tokens=warmup_tokens)
    suite = await run_suite(target, one_level, deadline)
    rates = [l.system_tok_s for l in suite.levels if l.workload == "uniform" and l.concurrency == level]
    if not rates:
        raise RuntimeError(f"no uniform result at c={level}: {suite.skipped}")
    return rates[0]


async def alternate(target: Any, engine: EngineChild, settings: LoadSettings, level: int, rounds: int,
                    deadline: float) -> EfficiencyResult:
    """HTTP round, engine round, K times, while time lasts (a round needs what the last one took)."""
    result = EfficiencyResult(level)
    engine.wait_ready(min(ENGINE_READY_TIMEOUT_S, max(1.0, deadline - time.perf_counter())))
    last_round_s = 0.0
    for _ in range(rounds):
        started = time.perf_counter()
        if deadline - started < 1.5 * last_round_s:
            result.note = f"stopped after {len(result.rounds)} rounds: time budget"
            break
        try:
            http = await http_rate(target, settings, level, deadline, warm_up=not result.rounds)
            record = engine.run_level(level, timeout_s=max(5.0, deadline - time.perf_counter()))
        except Exception as exc:  # the rounds already made still count
            if not result.rounds:
                raise
            result.note = f"stopped after {len(result.rounds)} rounds: {type(exc).__name__}: {exc}"[:500]
            break
        result.rounds.append(EfficiencyRound(round(http, 1), round(float(record["tok_per_s"]), 1)))
        last_round_s = time.perf_counter() - started
        print(f"  [efficiency] c={level} round {len(result.rounds)}: HTTP {http:.1f} / engine "
              f"{record['tok_per_s']:.1f} tok/s = {result.rounds[-1].ratio:.3f}", flush=True)
    return result


if __name__ == "__main__":
    main()
