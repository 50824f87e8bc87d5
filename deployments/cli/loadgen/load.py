"""Serving benchmark: an async OpenAI-streaming load generator against one running server (loopback only).

    python -m deployments.cli.loadgen.load --base-url http://127.0.0.1:8000 --model ID --vocab-size 151936 \
        --workloads mixed,uniform,same,long,burst --levels 1,4,8,16,32,64,128 --gen-tokens 128 --json out.json

Workloads (bench/README.md): closed-loop sweeps `mixed` (log-uniform 64-1024-token prompts),
`uniform` (fixed --prompt-tokens, as bench.engine_throughput), `same` (one prompt for all: prefix
reuse); `long` (one long prompt arrives while 16 streams decode); `burst` (N simultaneous
prompts vs a lone one). Everything is bounded by --time-budget-s; needs only aiohttp and numpy.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from deployments.cli.loadgen.batch_load import BatchLoadResult, run_batch_load
from deployments.cli.loadgen.client import StreamClient, Target
from deployments.cli.loadgen.stats import BurstResult, LevelResult, LongPromptResult
from deployments.cli.loadgen.tables import burst_table, level_note, level_table, long_table, show
from deployments.cli.loadgen.workloads import (
    SWEEP_WORKLOADS,
    WORKLOADS,
    LoadSettings,
    run_burst,
    run_long,
    run_sweep_level,
    warm_up,
    warm_up_prompts,
)

MIN_UNIT_S = 2.0  # a level with less time left than this is skipped (and listed as skipped)
SCENARIO_WEIGHTS = {"long": 3.0, "burst": 2.0, "batch": 8.0}  # in units of "one request per worker" sweep levels


@dataclass
class SuiteResult:
    server: str
    base_url: str
    levels: list[LevelResult] = field(default_factory=list)
    long: Optional[LongPromptResult] = None
    burst: Optional[BurstResult] = None
    batch: Optional[BatchLoadResult] = None
    skipped: list[str] = field(default_factory=list)
    warmup_errors: list[str] = field(default_factory=list)
    wall_s: float = 0.0


@dataclass
class Unit:
    workload: str
    concurrency: int
    weight: float  # share of the time budget


def plan_units(settings: LoadSettings) -> list[Unit]:
    """In --workloads order; each sweep level weighs its requests per worker (latency ~ requests in a row)."""
    units = []
    for workload in settings.workloads:
        if workload in SWEEP_WORKLOADS:
            units += [Unit(workload, c, float(settings.rpw(c))) for c in settings.levels]
        elif workload == "long":
            units.append(Unit("long", settings.long_background, SCENARIO_WEIGHTS["long"]))
        elif workload == "burst":
            units.append(Unit("burst", settings.burst_size, SCENARIO_WEIGHTS["burst"]))
        elif workload == "batch":
            units.append(Unit("batch", settings.batch_streams, SCENARIO_WEIGHTS["batch"]))
    return units


async def run_suite(
    target: Target, settings: LoadSettings, deadline: float, on_result: Optional[Callable[[SuiteResult], None]] = None
) -> SuiteResult:
    """All workloads against one server, finishing by `deadline` (time.perf_counter()); later levels get what is left."""
    suite = SuiteResult(target.name, target.base_url)
    started = time.perf_counter()
    units = plan_units(settings)
    weight_left = sum(u.weight for u in units)
    async with StreamClient(target, settings.request_timeout_s) as client:
        warm = await warm_up_prompts(client, settings, hard=started + 0.15 * (deadline - started))
        suite.warmup_errors += [r.error for r in warm if r.error]
        warmed: set[int] = set()
        for unit in units:
            now = time.perf_counter()
            budget = (deadline - now) * unit.weight / weight_left
            weight_left -= unit.weight
            if deadline - now < MIN_UNIT_S:
                suite.skipped.append(f"{unit.workload}@{unit.concurrency}: no time left")
                continue
            soft, hard = now + budget, min(deadline, now + budget + max(10.0, budget))
            if unit.workload in SWEEP_WORKLOADS and unit.concurrency not in warmed:
                warmed.add(unit.concurrency)
                warm = await warm_up(client, settings, unit.concurrency, hard=min(hard, now + 0.3 * budget + 5),
                                     workload=unit.workload)
                suite.warmup_errors += [r.error for r in warm if r.error]
            await _run_unit(client, settings, unit, soft, hard, suite)
            suite.wall_s = time.perf_counter() - started
            if on_result is not None:
                on_result(suite)
    suite.wall_s = time.perf_counter() - started
    return suite


async def _run_unit(client: StreamClient, settings: LoadSettings, unit: Unit, soft: float, hard: float, suite: SuiteResult) -> None:
    tag = f"[{suite.server}] {unit.workload:<7} c={unit.concurrency:<4}"
    if unit.workload == "long":
        suite.long = r = await run_long(client, settings, hard)
        print(f"  {tag} long ttft {r.long_ttft_s * 1e3:8.1f} ms  bg itl before p50 {r.itl_p50_ms_before:7.2f} ms  "
              f"during p99 {r.itl_p99_ms_during:7.2f} ms ({r.during_p99_over_p50:.2f}x)  err {r.errors} {r.note}", flush=True)
    elif unit.workload == "burst":
        suite.burst = r = await run_burst(client, settings, hard)
        print(f"  {tag} lone ttft {r.lone_ttft_s * 1e3:8.1f} ms  burst ttft p95 {r.ttft_p95_s * 1e3:8.1f} ms  "
              f"({r.p95_over_lone:.2f}x)  err {r.errors} slow connects {r.slow_connects} {r.note}", flush=True)
    elif unit.workload == "batch":
        suite.batch = r = await run_batch_load(client, settings, hard)
        print(f"  {tag} batch of {r.lines}: {r.status or '-'} {r.completed} done, {r.tok_s:9.1f} tok/s over "
              f"{r.wall_s:.1f} s; interactive TTFT P95 during / alone {r.ttft_p95_ratio:.2f}  {r.note}", flush=True)
    else:
        level = await run_sweep_level(client, settings, unit.workload, unit.concurrency, soft, hard)
        suite.levels.append(level)
        print(f"  {tag} {level.system_tok_s:9.1f} tok/s  ttft mean {level.ttft_mean_s * 1e3:8.1f} p95 "
              f"{level.ttft_p95_s * 1e3:8.1f} ms  itl p50 {level.itl_p50_ms:7.2f} p99 {level.itl_p99_ms:7.2f} ms  "
              f"reqs {level.requests} err {level.errors} {level_note(level)}", flush=True)
        if level.engine is not None:
            e = level.engine
            print(f"  {tag} engine: {e.steps} steps, {e.step_ms_mean:.2f} ms/step (thread CPU {e.step_cpu_ms_mean:.2f}), "
                  f"busy {e.busy_fraction:.0%}, model process {e.process_cpus:.2f} CPUs", flush=True)
            if e.replica_tok_s:
                shares = ", ".join(f"{rid} {rate:.1f}" for rid, rate in e.replica_tok_s.items())
                print(f"  {tag} replicas' generated tok/s: {shares}", flush=True)


def suite_tables(suite: SuiteResult) -> list:
    tables = [level_table(suite.server, suite.levels)] if suite.levels else []
    if suite.long is not None:
        tables.append(long_table({suite.server: suite.long}))
    if suite.burst is not None:
        tables.append(burst_table({suite.server: suite.burst}))
    return tables


def to_jsonable(obj: Any) -> Any:
    """Dataclasses to dicts; NaN to None (strict JSON)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = dataclasses.asdict(obj)
    if isinstance(obj, dict):
        return {k: to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, float) and obj != obj:
        return None
    return obj


def write_json(path: Path, payload: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(to_jsonable(payload), indent=2))
    tmp.replace(path)  # a reader (or a kill) never sees half a file


# ---- CLI (shared with bench.serving.compare and vision_compare)
def add_load_arguments(p: argparse.ArgumentParser) -> None:
    d = LoadSettings(levels=[], workloads=[], vocab_size=0)
    p.add_argument("--levels", default="1,4,8,16,32,64,128", help="comma-separated concurrency levels")
    p.add_argument("--workloads", default="mixed,uniform,burst,long,same", help=f"subset of {','.join(WORKLOADS)}, in run order")
    p.add_argument("--gen-tokens", type=int, default=d.gen_tokens, help="max_tokens of sweep requests")
    p.add_argument("--prompt-tokens", type=int, default=d.prompt_tokens, help="prompt words of the uniform workload")
    p.add_argument("--mixed-min-tokens", type=int, default=d.mixed_min_tokens)
    p.add_argument("--mixed-max-tokens", type=int, default=d.mixed_max_tokens)
    p.add_argument("--same-prompt-tokens", type=int, default=d.same_prompt_tokens)
    p.add_argument("--long-prompt-tokens", type=int, default=d.long_prompt_tokens)
    p.add_argument("--long-background", type=int, default=d.long_background)
    p.add_argument("--burst-size", type=int, default=d.burst_size)
    p.add_argument("--burst-prompt-tokens", type=int, default=d.burst_prompt_tokens)
    p.add_argument("--burst-gen-tokens", type=int, default=d.burst_gen_tokens)
    p.add_argument("--batch-lines", type=int, default=d.batch_lines, help="the batch workload's job (issue 58)")
    p.add_argument("--batch-streams", type=int, default=d.batch_streams, help="interactive streams beside the batch")
    p.add_argument("--requests-per-worker", type=int, default=d.requests_per_worker)
    p.add_argument("--requests-per-worker-high", type=int, default=d.requests_per_worker_high)
    p.add_argument("--high-from", type=int, default=d.high_from, help="levels >= this use --requests-per-worker-high")
    p.add_argument("--stagger-ms", type=float, default=d.stagger_ms, help="between the request starts of a sweep level's wave")
    p.add_argument("--burst-stagger-ms", type=float, default=d.burst_stagger_ms, help="between a burst's request starts")
    p.add_argument("--warmup-tokens", type=int, default=d.warmup_tokens, help="0 disables warm-up")
    p.add_argument("--request-timeout-s", type=float, default=d.request_timeout_s)
    p.add_argument("--seed", type=int, default=d.seed)


def settings_from_args(args: argparse.Namespace, vocab_size: int) -> LoadSettings:
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = set(workloads) - set(WORKLOADS)
    if unknown:
        raise SystemExit(f"unknown workloads {sorted(unknown)}; choose from {WORKLOADS}")
    names = {f.name for f in dataclasses.fields(LoadSettings)} - {"levels", "workloads", "vocab_size"}
    given = {k: v for k, v in vars(args).items() if k in names}
    levels = [int(x) for x in args.levels.split(",") if x.strip()]
    return LoadSettings(levels=levels, workloads=workloads, vocab_size=vocab_size, **given)


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="model id to send")
    p.add_argument("--name", default="server", help="label in tables and JSON")
    p.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: true (ours, vLLM; not mlx_lm.server)")
    p.add_argument("--vocab-size", type=int, default=500,
                   help="prompt words are t0 .. t<vocab-17> (one token each in tests.support.random_model tokenizers)")
    p.add_argument("--time-budget-s", type=float, default=600.0)
    p.add_argument("--json", help="write results here")
    add_load_arguments(p)
    return p.parse_args(argv)


def run_async(coro: Any) -> Any:
    try:
        import uvloop  # the client must not be the bottleneck at 128 streams
    except ImportError:
        return asyncio.run(coro)
    if hasattr(uvloop, "run"):
        return uvloop.run(coro)
    uvloop.install()  # uvloop < 0.18
    return asyncio.run(coro)


def main(argv: Optional[list[str]] = None) -> SuiteResult:
    args = parse_args(argv)
    settings = settings_from_args(args, args.vocab_size)
    target = Target(args.base_url, args.model, args.name, args.endpoint, {"ignore_eos": True} if args.ignore_eos else {})
    deadline = time.perf_counter() + args.time_budget_s
    save = (lambda s: write_json(Path(args.json), {"settings": settings, "suite": s})) if args.json else None
    suite = run_async(run_suite(target, settings, deadline, on_result=save))
    show(suite_tables(suite))
    if save is not None:
        save(suite)
        print(f"wrote {args.json}")
    return suite


if __name__ == "__main__":
    main()
