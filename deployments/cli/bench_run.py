"""`orchard bench`'s run (deployments/cli/bench.py has its arguments): the servers, the load, the report."""

from __future__ import annotations

import argparse
import importlib.metadata
import math
import platform
import subprocess
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)

from deployments.cli.loadgen.client import Target
from deployments.cli.loadgen.load import (
    SuiteResult,
    plan_units,
    run_async,
    run_suite,
    to_jsonable,
    write_json,
)
from deployments.cli.loadgen.plots import plot_metric
from deployments.cli.loadgen.tables import Table, burst_table, long_table, show, sweep_table
from deployments.cli.loadgen.workloads import SWEEP_WORKLOADS, LoadSettings
from deployments.cli.server_client import (
    auth_headers,
    base_url,
    default_url,
    is_loopback,
    not_running_message,
)

# Prompt words are "t0" .. "t483": one token each in bench's random models, a few in a real tokenizer.
PROMPT_VOCAB = 500
PLOTS = (("system_tok_s", "system tokens/s (all streams)", "throughput", 1.0),
         ("ttft_p95_s", "TTFT P95 (ms)", "ttft_p95", 1e3),
         ("itl_p50_ms", "ITL P50 (ms)", "itl_p50", 1.0))


@dataclass
class BenchTarget:
    name: str
    url: str
    model: str


class BenchRefused(Exception):
    """The run cannot start: a bad argument, a server that does not answer, a model it does not serve."""


def run_bench(args: argparse.Namespace, workloads: dict[str, str]) -> int:
    """`workloads`: the user's names for the load generator's workloads (bench.py's WORKLOADS)."""
    console = Console()
    try:
        settings = load_settings(args, workloads)
        targets = resolve_targets(args)
    except BenchRefused as exc:
        console.print(f"[red]orchard bench:[/] {exc}")
        return 1
    out = Path(args.out or f"orchard-bench-{datetime.now():%Y%m%d-%H%M%S}")
    planned = sum(c * settings.rpw(c) for c in settings.levels) * sum(w in SWEEP_WORKLOADS for w in settings.workloads)
    console.print(f"orchard bench: {', '.join(f'{t.name} = {t.url} ({t.model})' for t in targets)}; "
                  f"workload {args.workload}, concurrency {','.join(map(str, settings.levels))}, "
                  f"up to {planned} sweep requests per server, at most {args.duration:g} s")
    try:
        suites = run_targets(console, targets, settings, args)
    except KeyboardInterrupt:
        console.print("orchard bench: interrupted; nothing written")
        return 130
    report = bench_report(targets, settings, suites, workloads)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "bench.json", report)
    show(result_tables(report, suites))
    written = [out / "bench.json", *write_plots(report, out)]
    console.print("wrote " + ", ".join(str(p) for p in written))
    if not any(level.ok for suite in suites for level in suite.levels) and not _scenarios_ok(suites):
        console.print("[red]orchard bench:[/] no request succeeded: " + "; ".join(_error_samples(suites)))
        return 1
    return 0


def load_settings(args: argparse.Namespace, workloads: dict[str, str]) -> LoadSettings:
    names = [w.strip() for w in args.workload.split(",") if w.strip()]
    unknown = [w for w in names if w not in workloads]
    if unknown or not names:
        raise BenchRefused(f"--workload: unknown {unknown or names}; choose from {', '.join(workloads)}")
    try:
        levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        raise BenchRefused(f"--concurrency: integers, comma-separated (got {args.concurrency!r})") from None
    if not levels or min(levels) < 1 or max(levels) > 256:
        raise BenchRefused(f"--concurrency: levels from 1 to 256 (got {args.concurrency!r})")
    for name in ("requests_per_stream", "gen_tokens"):
        if getattr(args, name) < 1:
            raise BenchRefused(f"--{name.replace('_', '-')} must be >= 1")
    if not args.duration > 0:
        raise BenchRefused("--duration must be > 0")
    top = max(levels)
    # Prompt sizes in words ("t123" is 3-4 tokens in a real tokenizer), sized for a laptop or a CPU: bench/'s
    # defaults (1k-word chat prompts, an 8k-word long prompt) are for GPUs and take minutes per request on a CPU.
    return LoadSettings(
        levels=levels, workloads=[workloads[w] for w in names], vocab_size=PROMPT_VOCAB, gen_tokens=args.gen_tokens,
        mixed_min_tokens=16, mixed_max_tokens=256, prompt_tokens=64, same_prompt_tokens=128, long_prompt_tokens=1024,
        long_background=min(top, 16), burst_size=top, burst_prompt_tokens=128,
        burst_gen_tokens=min(32, args.gen_tokens),
        requests_per_worker=args.requests_per_stream, requests_per_worker_high=args.requests_per_stream,
        request_timeout_s=min(300.0, args.duration),
    )


def resolve_targets(args: argparse.Namespace) -> list[BenchTarget]:
    names = [n.strip() for n in args.names.split(",")]
    urls = [args.url or default_url()] + ([args.against] if args.against else [])
    if len(names) < len(urls) or len(set(names[: len(urls)])) < len(urls) or not all(names[: len(urls)]):
        raise BenchRefused(f"--names: {len(urls)} different labels, comma-separated (got {args.names!r})")
    targets, wanted = [], [args.model, args.against_model]
    for index, (name, raw) in enumerate(zip(names, urls)):
        try:
            url = base_url(raw)
        except ValueError as exc:
            raise BenchRefused(str(exc)) from None
        if not args.allow_remote and not is_loopback(url):
            raise BenchRefused(f"{url} is not on this machine: load tests run against loopback servers only; pass "
                               "--allow-remote if the server is yours")
        served = listed_model_ids(url, args.api_key)
        model = wanted[index] or (args.model if index and args.model in served else None) or served[0]
        if model not in served:
            raise BenchRefused(f"unknown model {model!r} at {url}; it serves: {', '.join(served)}")
        targets.append(BenchTarget(name, url, model))
    return targets


def listed_model_ids(url: str, api_key: str | None) -> list[str]:
    """The ids /v1/models lists (any OpenAI-compatible server; /health is ours only)."""
    try:
        reply = httpx.get(f"{url}/v1/models", headers=auth_headers(api_key), timeout=10.0)
    except httpx.ConnectError:
        raise BenchRefused(not_running_message(url)) from None
    except httpx.HTTPError as exc:
        raise BenchRefused(f"{url}/v1/models did not answer: {type(exc).__name__} {exc}") from None
    if reply.status_code != 200:
        raise BenchRefused(f"{url}/v1/models answered {reply.status_code}: {reply.text[:200]}")
    models = [m["id"] for m in reply.json().get("data") or [] if isinstance(m, dict) and m.get("id")]
    if not models:
        raise BenchRefused(f"{url} serves no model yet (still loading? see `orchard top --url {url}`)")
    return models


def run_targets(console: Console, targets: list[BenchTarget], settings: LoadSettings,
                args: argparse.Namespace) -> list[SuiteResult]:
    """One server after the other, each with an equal share of --duration; a bar counts the finished units."""
    units = len(plan_units(settings))
    started, suites = time.perf_counter(), []
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        for index, target in enumerate(targets):
            task = progress.add_task(f"{target.name} ({target.model})", total=units)
            share = (args.duration - (time.perf_counter() - started)) / (len(targets) - index)
            extra = {"ignore_eos": True} if args.ignore_eos else {}
            bench_target = Target(target.url, target.model, target.name, "chat", extra, auth_headers(args.api_key))

            def advance(suite: SuiteResult, task=task) -> None:
                done = len(suite.levels) + (suite.long is not None) + (suite.burst is not None) + len(suite.skipped)
                progress.update(task, completed=done)

            suite = run_async(run_suite(bench_target, settings, time.perf_counter() + share, on_result=advance))
            progress.update(task, completed=units)
            suites.append(suite)
    return suites


def bench_report(targets: list[BenchTarget], settings: LoadSettings, suites: list[SuiteResult],
                 workloads: dict[str, str]) -> dict:
    """bench.serving.compare's report shape (servers -> suite), so the load generator's tables and plots read it."""
    return to_jsonable({
        "kind": "orchard_bench",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "workload_names": {v: k for k, v in workloads.items()},
        "targets": {t.name: {"url": t.url, "model": t.model} for t in targets},
        "model": {"model_type": targets[0].model},  # the plots' title names the first server's model
        "git_commit": orchard_version(),
        "machine": {"default_device": f"{platform.system()} {platform.machine()}"},
        "settings": settings,
        "servers": {suite.server: suite for suite in suites},
    })


def orchard_version() -> str:
    """The checkout's commit where Orchard runs from a git clone, else the installed version."""
    try:
        found = subprocess.run(["git", "-C", str(Path(__file__).parent), "rev-parse", "--short", "HEAD"],
                               check=False, capture_output=True, text=True, timeout=5)
        if found.returncode == 0 and found.stdout.strip():
            return found.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    try:
        return f"orchard-serve {importlib.metadata.version('orchard-serve')}"
    except importlib.metadata.PackageNotFoundError:
        return "orchard-serve (version unknown)"


def result_tables(report: dict, suites: list[SuiteResult]) -> list[Table]:
    tables = [t for w in SWEEP_WORKLOADS if (t := sweep_table(report, w)) is not None]
    longs = {s.server: s.long for s in suites if s.long is not None}
    bursts = {s.server: s.burst for s in suites if s.burst is not None}
    return tables + ([long_table(longs)] if longs else []) + ([burst_table(bursts)] if bursts else [])


def write_plots(report: dict, out: Path) -> list[Path]:
    """One PNG per metric, a panel per sweep workload (the long and burst scenarios have tables only)."""
    written = []
    for key, ylabel, stem, scale in PLOTS:
        path = out / f"{stem}.png"
        if plot_metric(report, key, ylabel, path, scale):
            written.append(path)
    return written


def _scenarios_ok(suites: list[SuiteResult]) -> bool:
    return any((s.long is not None and not math.isnan(s.long.long_ttft_s)) or
               (s.burst is not None and s.burst.errors < s.burst.burst_size) for s in suites)


def _error_samples(suites: list[SuiteResult]) -> list[str]:
    samples = [e for s in suites for level in s.levels for e in level.error_samples] + \
              [e for s in suites for e in s.warmup_errors]
    return list(dict.fromkeys(samples))[:3] or ["no request finished in time (raise --duration?)"]
