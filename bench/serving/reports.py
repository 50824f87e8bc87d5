"""The serving benchmarks' reports, read as plain dicts (as in their JSON): bench.serving.compare's side-by-side
tables and acceptance checks, bench.serving.vision_compare's, and the soak test's summary, verdict and the server's
state it reads before and after its run (bench/soak.py).

Issue 27's goals (vision_compare): ours / mlx_vlm.server system tok/s >= 1.0 at 1 stream and >= 1.5 at 8 and 32 (1.0
below 8, 1.5 from 8 up at other levels); ours with half the requests carrying an image (`image_mix`) >= 0.90 of ours
with text-only requests of about the same tokens (`text_only`) at the mix level, median of the rounds.

Plots, from a compare or vision_compare JSON (needs matplotlib; run it here, not on the device):
    python -m bench.serving.reports results.json --out DIR
compare: DIR/<json stem>_throughput.png and DIR/<json stem>_ttft_p95.png, one panel per sweep workload, log2 x axis;
the throughput panel of `uniform` also shows the in-process engine rate. vision_compare: one DIR/<json stem>.png,
throughput and TTFT P95 of the `image` sweep side by side, with our text_only and image_mix medians at the mix level
as single points.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import math
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import aiohttp

from bench.serving.answers import Answer
from deployments.cli.loadgen.plots import STYLE, plot_metric, series, title_of
from deployments.cli.loadgen.stats import BurstResult, LongPromptResult, percentile
from deployments.cli.loadgen.tables import (
    OURS,
    REFERENCE,
    Table,
    burst_table,
    engine_rates,
    fmt,
    long_table,
    number,
    ratio,
    sweep_table,
    workload_levels,
)

HTTP_EFFICIENCY_BOUND = 0.85  # HTTP / in-process engine at 64 streams (the first acceptance point)
# A lone stream's decode rate over HTTP: against the in-process engine's and mlx_lm.server's (issue 32).
LONE_STREAM_ENGINE_BOUND = 0.9
LONE_STREAM_REFERENCE_BOUND = 1.5
VISION_REFERENCE = "mlx_vlm"
RAPID_MLX = "rapid_mlx"  # compare's third server (issue 57)
MIX_BOUND = 0.90
FAILURES = ("server_error", "hung", "stream_error", "invalid", "client_error", "connection_error")
KEPT_FAILURES = 200  # failed answers kept whole in the JSON (all are counted)


# ---- bench.serving.compare: side by side, acceptance checks
def _scenario(report: dict, key: str, cls: type) -> dict[str, Any]:
    out = {}
    for server, suite in (report.get("servers") or {}).items():
        data = (suite or {}).get(key)
        if data:
            out[server] = cls(**{k: (float("nan") if v is None else v) for k, v in data.items()})
    return out


def comparison_tables(report: dict) -> list[Table]:
    tables = [t for w in ("mixed", "uniform", "same") if (t := sweep_table(report, w)) is not None]
    longs = _scenario(report, "long", LongPromptResult)
    if longs:
        tables.append(long_table(longs))
    bursts = _scenario(report, "burst", BurstResult)
    if bursts:
        tables.append(burst_table(bursts))
    checks = acceptance_checks(report)
    if checks:
        rows = [[c["check"], c["value"], c["limit"], c["verdict"]] for c in checks]
        tables.append(Table("issue acceptance (this run)", ["check", "measured", "needs", "verdict"], rows))
    return tables


def _check(name: str, value: float, limit: str, passed: Optional[bool]) -> dict[str, str]:
    verdict = "n/a" if passed is None else ("PASS" if passed else "FAIL")
    return {"check": name, "value": fmt(value, 3), "limit": limit, "verdict": verdict}


def _lone_stream_checks(report: dict) -> list[dict[str, str]]:
    """One stream's decode rate (tokens after its first / the time after it): over HTTP against the in-process
    engine's (uniform workload, c=1) and against mlx_lm.server's over HTTP."""
    ours = workload_levels(report, OURS, "uniform").get(1, {}).get("req_tok_s_p50")
    if ours is None:
        return []
    engine = next((r.get("decode_tok_per_s") for r in (report.get("engine") or {}).get("results") or []
                   if r["concurrency"] == 1), None)
    reference = workload_levels(report, REFERENCE, "uniform").get(1, {}).get("req_tok_s_p50")
    checks = []
    for name, other, bound in (("in-process engine", engine, LONE_STREAM_ENGINE_BOUND),
                               (f"{REFERENCE} over HTTP", reference, LONE_STREAM_REFERENCE_BOUND)):
        value = number(ours) / number(other) if other else float("nan")
        checks.append(_check(f"{OURS} lone stream decode tok/s over HTTP / {name}, uniform, c=1", value,
                             f">= {bound}", None if value != value else value >= bound))
    return checks


def _efficiency_check(report: dict) -> list[dict[str, str]]:
    """The same ratio from alternating rounds (compare --efficiency-rounds), where the run made them."""
    efficiency = report.get("efficiency") or {}
    rounds = efficiency.get("rounds") or []
    if not rounds:
        return []
    value = number(efficiency.get("median_ratio"))
    each = ", ".join(fmt(r["ratio"], 3) for r in rounds)
    name = f"{OURS} HTTP / in-process engine, uniform, c={efficiency['level']}, median of {len(rounds)} alternating rounds ({each})"
    bound = LONE_STREAM_ENGINE_BOUND if efficiency["level"] == 1 else HTTP_EFFICIENCY_BOUND
    return [_check(name, value, f">= {bound}", None if value != value else value >= bound)]


def acceptance_checks(report: dict, throughput_workload: str = "mixed") -> list[dict[str, str]]:
    """The issue's acceptance figures as measured in this run (n/a where a side is missing)."""
    checks = []
    engine = engine_rates(report)
    uniform = workload_levels(report, OURS, "uniform")
    for c in sorted(set(uniform) & set(engine)):
        if c == 64 or c == max(set(uniform) & set(engine)):
            value = number(uniform[c].get("system_tok_s")) / engine[c] if engine[c] else float("nan")
            checks.append(_check(f"{OURS} HTTP / in-process engine, uniform, c={c}", value,
                                 f">= {HTTP_EFFICIENCY_BOUND}", value >= HTTP_EFFICIENCY_BOUND))
    checks += _efficiency_check(report)
    checks += _lone_stream_checks(report)
    checks += batch_checks(report, engine)
    checks += replica_checks(report)
    ours = workload_levels(report, OURS, throughput_workload)
    ref = workload_levels(report, REFERENCE, throughput_workload)
    for c in sorted(set(ours) & set(ref)):
        if c in (8, 32, 64) or c == max(set(ours) & set(ref)):
            a, b = number(ours[c].get("system_tok_s")), number(ref[c].get("system_tok_s"))
            value = a / b if b else float("nan")
            checks.append(_check(f"orchard / mlx_lm system tok/s, {throughput_workload}, c={c}", value, ">= 1.0", value >= 1.0))
    rapid = workload_levels(report, RAPID_MLX, throughput_workload)
    for c in sorted(set(ours) & set(rapid)):  # issue 57 asks for the figures beside Rapid-MLX, no bound
        a, b = number(ours[c].get("system_tok_s")), number(rapid[c].get("system_tok_s"))
        checks.append(_check(f"orchard / {RAPID_MLX} system tok/s, {throughput_workload}, c={c}",
                             a / b if b else float("nan"), "report", None))
    bursts = _scenario(report, "burst", BurstResult)
    for server, b in bursts.items():
        checks.append(_check(f"{server} burst {b.burst_size} TTFT P95 / lone TTFT", b.p95_over_lone, "<= 3",
                             None if b.p95_over_lone != b.p95_over_lone else b.p95_over_lone <= 3))
    for server, l in _scenario(report, "long", LongPromptResult).items():
        # ITL P99 inside the prefill window vs the decode-only median (whole-window P99 as a hint).
        for label, value in (("during prefill / decode-only P50", l.during_p99_over_p50), ("whole window", l.p99_over_p50)):
            checks.append(_check(f"{server} ITL P99 / P50 of {l.background_streams} streams, "
                                 f"{l.long_prompt_words}-token prompt, {label}", value, "< 4",
                                 None if value != value else value < 4))
    return checks


BATCH_ROWS = 16  # lines a batch runs at once (deployments/batches/runner.py): the in-process rate it is held to


def batch_checks(report: dict, engine: dict[int, float]) -> list[dict[str, str]]:
    """Issue 58: a Batches API job's tok/s >= 0.8 of the in-process engine's at its batch size (engine baseline
    level 16), and interactive TTFT P95 beside it <= 1.2x without it."""
    checks = []
    for server, suite in (report.get("servers") or {}).items():
        batch = (suite or {}).get("batch")
        if not batch or batch.get("status") != "completed":
            continue
        rate = engine.get(BATCH_ROWS)
        value = number(batch["tok_s"]) / rate if rate else float("nan")
        checks.append(_check(f"{server} batch of {batch['lines']} lines tok/s / in-process engine at {BATCH_ROWS} rows",
                             value, ">= 0.8", None if value != value else value >= 0.8))
        ratio = number(batch.get("ttft_p95_ratio"))
        checks.append(_check(f"{server} interactive TTFT P95 at {batch['streams']} streams, during the batch / alone",
                             ratio, "<= 1.2", None if ratio != ratio else ratio <= 1.2))
    return checks


REPLICA_SCALING_BOUND = 1.8  # 2 replicas on 2 GPUs / 1 on 1 (issue 56)


def replica_checks(report: dict) -> list[dict[str, str]]:
    """orchard_r2 / orchard_r1 phases (compare --servers orchard_r2,orchard_r1,...), per workload and level: the
    median over the rounds' pairs of system tok/s (>= 1.8) and of TTFT P95 (not worse: <= 1); and where the run
    has level c/2, the most two replicas can give: 2 x one replica's tok/s at c/2 over its tok/s at c (each
    replica then holds c/2 streams), for a sole replica whose rate still grows with its rows."""
    servers = report.get("servers") or {}
    rounds = {n: [k for k in servers if k.split("#")[0] == f"orchard_r{n}"] for n in (1, 2)}
    pairs = list(zip(rounds[2], rounds[1]))
    if not pairs:
        return []
    checks = []
    for workload in ("mixed", "uniform"):
        levels = sorted(set.intersection(*(set(workload_levels(report, k, workload)) for pair in pairs for k in pair)))
        for c in levels:
            checks += _replica_level_checks(report, workload, c, pairs)
    return checks


def _replica_level_checks(report: dict, workload: str, c: int, pairs: list[tuple[str, str]]) -> list[dict[str, str]]:
    def rate(server: str, level: int, key: str = "system_tok_s") -> float:
        return number(workload_levels(report, server, workload).get(level, {}).get(key))

    checks = []
    for key, bound, passes in (("system_tok_s", f">= {REPLICA_SCALING_BOUND}", lambda v: v >= REPLICA_SCALING_BOUND),
                               ("ttft_p95_s", "<= 1.0", lambda v: v <= 1.0)):
        each = [rate(two, c, key) / rate(one, c, key) for two, one in pairs]
        value = statistics.median(each)
        checks.append(_check(f"2 replicas / 1, {key}, {workload}, c={c}, median of {len(each)} pairs "
                             f"({', '.join(fmt(v, 3) for v in each)})", value, bound,
                             None if value != value else passes(value)))
    ceiling = statistics.median(2 * rate(one, c // 2) / rate(one, c) for _, one in pairs)
    if ceiling == ceiling:
        checks.append(_check(f"most 2 replicas can give, {workload}, c={c}: 2 x 1 replica's tok/s at c={c // 2} / at "
                             f"c={c}", ceiling, "(ceiling)", None))
    return checks


# ---- bench.serving.vision_compare (issue 27)
def throughput_bound(concurrency: int) -> float:
    return 1.0 if concurrency < 8 else 1.5


def _value(level: Optional[dict], key: str, scale: float = 1.0) -> float:
    value = (level or {}).get(key)
    return float("nan") if value is None else float(value) * scale


def _counts(level: Optional[dict]) -> str:
    if not level:
        return "-"
    return f"{level['requests']}/{level['errors']}/{level['short']}"


def image_table(report: dict) -> Optional[Table]:
    servers = list((report.get("servers") or {}).keys())
    per_server = {s: workload_levels(report, s, "image") for s in servers}
    levels = sorted({c for rows in per_server.values() for c in rows})
    if not levels:
        return None
    pair = OURS in servers and VISION_REFERENCE in servers
    header = ["conc"] + [f"{s} tok/s" for s in servers] + (["ours/ref tok/s"] if pair else [])
    header += [f"{s} ttft {q} ms" for s in servers for q in ("p50", "p95")] + (["ours/ref ttft p95"] if pair else [])
    header += [f"{s} prompt tok" for s in servers] + [f"{s} reqs/err/short" for s in servers]
    rows = []
    for c in levels:
        at = {s: per_server[s].get(c) for s in servers}
        row = [str(c)] + [fmt(_value(at[s], "system_tok_s")) for s in servers]
        row += [ratio(_value(at.get(OURS), "system_tok_s"), _value(at.get(VISION_REFERENCE), "system_tok_s"))] if pair else []
        row += [fmt(_value(at[s], key, 1e3)) for s in servers for key in ("ttft_p50_s", "ttft_p95_s")]
        row += [ratio(_value(at.get(OURS), "ttft_p95_s"), _value(at.get(VISION_REFERENCE), "ttft_p95_s"))] if pair else []
        row += [fmt(_value(at[s], "usage_prompt_tokens_mean"), 0) for s in servers] + [_counts(at[s]) for s in servers]
        rows.append(row)
    images = report.get("images") or {}
    what = (f"one {images.get('width')}x{images.get('height')} {images.get('format')} image + "
            f"{images.get('question_tokens')}-token question per request") if images else "image requests"
    return Table(f"image: {what}; system tok/s and TTFT per concurrency level", header, rows)


def mix_table(report: dict) -> Optional[Table]:
    header = ["server", "conc", "round", "text_only tok/s", "image_mix tok/s", "mix/text", "tower floor",
              "text_only ttft p95 ms", "image_mix ttft p95 ms", "images / reqs (mix)", "tower s (mix)", "err"]
    rows = []
    for server, mix in (report.get("mix") or {}).items():
        for r in (mix or {}).get("rounds") or []:
            text, mixed = r["text_only"], r["image_mix"]
            tower_s = (mixed.get("engine") or {}).get("tower_s")
            rows.append([server, str(mix["level"]), str(r["round"]), fmt(_value(text, "system_tok_s")),
                         fmt(_value(mixed, "system_tok_s")), fmt(r["ratio"], 3), fmt(r.get("tower_floor"), 3),
                         fmt(_value(text, "ttft_p95_s", 1e3)), fmt(_value(mixed, "ttft_p95_s", 1e3)),
                         f"{mixed['image_requests']} / {mixed['requests']}", fmt(tower_s, 2),
                         str(text["errors"] + mixed["errors"])])
        if mix and mix.get("rounds"):
            rows.append([server, str(mix["level"]), "median", "", "", fmt(mix.get("median_ratio"), 3),
                         fmt(mix.get("median_tower_floor"), 3), "", "", "", "", mix.get("note") or ""])
    return Table("mixed text + image load vs text-only (alternating rounds)", header, rows) if rows else None


def vision_checks(report: dict) -> list[dict[str, str]]:
    checks = []
    ours, ref = workload_levels(report, OURS, "image"), workload_levels(report, VISION_REFERENCE, "image")
    for c in sorted(set(ours) & set(ref)):
        a, b = _value(ours[c], "system_tok_s"), _value(ref[c], "system_tok_s")
        value = a / b if b else float("nan")
        bound = throughput_bound(c)
        errors = ours[c]["errors"] + ref[c]["errors"]
        checks.append(_check(f"{OURS} / {VISION_REFERENCE} system tok/s, image, c={c}{_failed(errors)}", value, f">= {bound}",
                             None if errors or math.isnan(value) else value >= bound))
    mix = (report.get("mix") or {}).get(OURS) or {}
    if mix.get("rounds"):
        value = _value(mix, "median_ratio")
        each = ", ".join(fmt(r["ratio"], 3) for r in mix["rounds"])
        errors = sum(r[w]["errors"] for r in mix["rounds"] for w in ("text_only", "image_mix"))
        checks.append(_check(f"{OURS} image_mix / text_only system tok/s, c={mix['level']}, median of "
                             f"{len(mix['rounds'])} rounds ({each}){_failed(errors)}", value, f">= {MIX_BOUND}",
                             None if errors or math.isnan(value) else value >= MIX_BOUND))
    return checks


def _failed(errors: int) -> str:
    """A ratio over failed requests means nothing: the check then says so and gives no verdict."""
    return f" [{errors} failed requests]" if errors else ""


def vision_tables(report: dict) -> list[Table]:
    tables = [t for t in (image_table(report), mix_table(report)) if t is not None]
    checks = vision_checks(report)
    if checks:
        rows = [[c["check"], c["value"], c["limit"], c["verdict"]] for c in checks]
        tables.append(Table("issue 27 acceptance (this run)", ["check", "measured", "needs", "verdict"], rows))
    return tables


# ---- bench/soak.py
def summarize(answers: list[Answer], planned: int, wall_s: float) -> dict[str, Any]:
    outcomes = Counter(a.outcome for a in answers)
    ok = [a for a in answers if a.outcome == "ok"]
    ttfts = [a.ttft_s for a in ok if a.ttft_s is not None]
    failed = [a for a in answers if a.outcome in FAILURES]
    return {
        "planned": planned, "sent": len(answers), "not_started": planned - len(answers), "wall_s": round(wall_s, 1),
        "outcomes": {k: outcomes.get(k, 0) for k in ("ok", "overload", "disconnected", *FAILURES)},
        "statuses": {str(k): v for k, v in sorted(Counter(a.status for a in answers).items(), key=lambda kv: str(kv[0]))},
        "server_errors_5xx": sum(1 for a in answers if a.status is not None and a.status >= 500),
        "latency_s": _quantiles([a.latency_s for a in ok]), "ttft_s": _quantiles(ttfts),
        "latency_s_by_outcome": {k: _quantiles([a.latency_s for a in answers if a.outcome == k]) for k in sorted(outcomes)},
        "latency_s_by_model": {m: _quantiles([a.latency_s for a in ok if a.shape.model == m])
                               for m in sorted({a.shape.model for a in answers})},
        "json_sent": sum(1 for a in answers if a.shape.json_schema),
        "json_checked": sum(1 for a in ok if a.shape.json_schema and a.finish == "stop"),
        "by_model": _outcomes_by(answers, lambda a: a.shape.model),
        "by_api": _outcomes_by(answers, lambda a: a.shape.api + ("/stream" if a.shape.stream else "")),
        "failures": [answer_record(a) for a in failed[:KEPT_FAILURES]],
        "slowest": [answer_record(a) for a in sorted(answers, key=lambda a: -a.latency_s)[:5]],
    }


def _outcomes_by(answers: list[Answer], key: Callable[[Answer], str]) -> dict[str, dict[str, int]]:
    groups: dict[str, Counter] = defaultdict(Counter)
    for a in answers:
        groups[key(a)][a.outcome] += 1
    return {k: dict(v) for k, v in sorted(groups.items())}


def _quantiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p95": None, "max": None}
    return {"p50": round(percentile(values, 50), 4), "p95": round(percentile(values, 95), 4), "max": round(max(values), 4)}


def answer_record(a: Answer) -> dict[str, Any]:
    record = asdict(a)
    record["shape"]["prompt"] = a.shape.prompt[:200]
    record["latency_s"] = round(a.latency_s, 3)
    return record


def verdict(report: dict[str, Any]) -> dict[str, Any]:
    reasons = [f"{report['outcomes'][k]} {k}" for k in FAILURES if report["outcomes"][k]]
    if report["server_errors_5xx"] and not report["outcomes"]["server_error"]:
        reasons.append(f"{report['server_errors_5xx']} 5xx")
    if not report["idle_after"]:
        reasons.append("not idle after the run (running, waiting or KV above baseline): a leak")
    if report["health_after"]["http_status"] != 200:
        reasons.append(f"/health answers {report['health_after']} after the run")
    if report["sent"] == 0:
        reasons.append("no request was sent")
    hostile = report.get("hostile") or {}
    if hostile.get("sent") and hostile["refused_as_expected"] != hostile["sent"]:
        reasons.append(f"{hostile['sent'] - hostile['refused_as_expected']} hostile requests not refused as expected")
    if report.get("engines_before") is not None and report.get("engines_after") != report["engines_before"]:
        reasons.append("an engine process died or restarted during the run")
    return {"passed": not reasons, "reasons": reasons}


def _triple(q: dict[str, float | None]) -> str:
    return f"{fmt(q['p50'], 3)} / {fmt(q['p95'], 3)} / {fmt(q['max'], 3)}"


def table(report: dict[str, Any]) -> Table:
    o, lat = report["outcomes"], report["latency_s"]
    rows = [["requests (sent / planned)", f"{report['sent']} / {report['planned']}"],
            ["statuses", ", ".join(f"{k}: {v}" for k, v in report["statuses"].items())],
            ["ok / disconnected / overload (429)", f"{o['ok']} / {o['disconnected']} / {o['overload']}"],
            ["5xx / hung", f"{report['server_errors_5xx']} / {o['hung']}"],
            ["stream errors / invalid / other 4xx / conn errors",
             f"{o['stream_error']} / {o['invalid']} / {o['client_error']} / {o['connection_error']}"],
            ["latency p50 / p95 / max s (ok)", _triple(lat)],
            *[[f"  {model}", _triple(q)] for model, q in report["latency_s_by_model"].items()],
            ["TTFT p50 / p95 s (ok streams)", f"{fmt(report['ttft_s']['p50'], 3)} / {fmt(report['ttft_s']['p95'], 3)}"],
            ["wall s (+ settle s)", f"{report['wall_s']} (+ {report['settle_s']})"]]
    for model, before in report["state_before"].items():
        after = report["state_after"][model]
        states = [f"{s['running']}/{s['waiting']}/{s['kv_cache_bytes']}" for s in (before, after)]
        rows.append([f"{model}: running/waiting/KV bytes", " -> ".join(states)])
    if "serve_log_errors" in report:
        logged = report["serve_log_errors"]
        rows.append(["Serve log ERROR lines / tracebacks", f"{logged['error_lines']} / {logged['tracebacks']}"])
    rows.append(["health before -> after", f"{report['health_before']['status']} -> {report['health_after']['status']}"])
    hostile = report.get("hostile") or {}
    if hostile.get("sent"):
        rows.append(["hostile: refused as expected / sent (max s; over 2 s)",
                     f"{hostile['refused_as_expected']} / {hostile['sent']} ({hostile['max_s']}; {hostile['over_bound']})"])
    passed = report["verdict"]["passed"]
    rows.append(["verdict", "PASS" if passed else "FAIL: " + "; ".join(report["verdict"]["reasons"])])
    return Table("soak", ["", "value"], rows)


# ---- the soak's server state: before and after a run, and back to idle
@dataclass
class ModelState:
    """One model's row of /v1/queue/stats."""

    status: str | None
    waiting: int | None
    running: int | None
    kv_cache_bytes: int | None


@dataclass
class Settle:
    idle: bool
    seconds: float
    models: dict[str, ModelState] = field(default_factory=dict)


class StatsUnavailable(RuntimeError):
    """/v1/queue/stats did not answer 200 (say, behind a key this run was not given)."""


async def read_state(session: aiohttp.ClientSession, url: str, models: list[str]) -> dict[str, ModelState]:
    async with session.get(url + "/v1/queue/stats") as resp:
        if resp.status != 200:
            raise StatsUnavailable(f"/v1/queue/stats answered {resp.status}: {(await resp.text())[:300]}")
        rows = {r["id"]: r for r in (await resp.json())["models"]}
    return {m: ModelState(rows.get(m, {}).get("status"), rows.get(m, {}).get("waiting"),
                          rows.get(m, {}).get("running"), rows.get(m, {}).get("kv_cache_bytes")) for m in models}


async def read_health(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(url + "/health") as resp:
        text = await resp.text()
    try:
        status = json.loads(text).get("status")
    except (ValueError, AttributeError):
        status = f"not a JSON object: {text[:100]!r}"
    return {"http_status": resp.status, "status": status}


def is_idle(now: ModelState, baseline: ModelState) -> bool:
    return (now.waiting == 0 and now.running == 0 and now.kv_cache_bytes is not None
            and now.kv_cache_bytes <= (baseline.kv_cache_bytes or 0))


async def settle(session: aiohttp.ClientSession, url: str, baseline: dict[str, ModelState], timeout_s: float) -> Settle:
    """Poll until every model is idle (running and waiting 0, KV at most its baseline), at most timeout_s."""
    started = time.perf_counter()
    unknown = ModelState(None, None, None, None)
    while True:
        try:
            now = await read_state(session, url, list(baseline))
        except (StatsUnavailable, aiohttp.ClientError, asyncio.TimeoutError):  # a server restarting: not idle yet
            now = {m: unknown for m in baseline}
        elapsed = time.perf_counter() - started
        if all(is_idle(now[m], baseline[m]) for m in baseline) or elapsed > timeout_s:
            return Settle(all(is_idle(now[m], baseline[m]) for m in baseline), round(elapsed, 1), now)
        await asyncio.sleep(0.5)


def asdict_map(states: dict[str, ModelState]) -> dict[str, dict[str, Any]]:
    return {m: asdict(s) for m, s in states.items()}


async def read_engines(session: aiohttp.ClientSession, url: str, models: list[str]) -> dict[str, Any] | None:
    """Each model's engine pid and restart count (loaded-models): a change across the run is a process death. None
    where the admin routes are off or need a key this run was not given."""
    async with session.get(url + "/v1/admin/loaded-models") as resp:
        if resp.status != 200:
            return None
        rows = {r["id"]: r for r in (await resp.json())["data"]}
    return {m: {"engine_pid": rows.get(m, {}).get("engine_pid"), "engine_restarts": rows.get(m, {}).get("engine_restarts")}
            for m in models}


# ---- plots --------------------------------------------------------------------------------------------------
MIX_STYLE = {"text_only": dict(color="tab:green", marker="^", linestyle="none", fillstyle="none", markersize=9),
             "image_mix": dict(color="tab:olive", marker="D", linestyle="none", markersize=7)}


def mix_points(report: dict, server: str, key: str, scale: float) -> dict[str, tuple[int, float]]:
    """workload -> (level, median over the rounds) of a vision report's text_only / image_mix rounds."""
    mix = (report.get("mix") or {}).get(server) or {}
    points = {}
    for workload in MIX_STYLE:
        values = [r[workload][key] * scale for r in mix.get("rounds") or [] if r[workload].get(key) is not None]
        if values:
            points[workload] = (mix["level"], statistics.median(values))
    return points


def plot_vision(report: dict, path: Path) -> bool:
    """Throughput and TTFT P95 of the image sweep, one panel each, in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = (("system_tok_s", "system tokens/s (all streams)", 1.0), ("ttft_p95_s", "TTFT P95 (ms)", 1e3))
    if not series(report, "image", "system_tok_s"):
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    for ax, (key, ylabel, scale) in zip(axes, metrics, strict=True):
        lines = series(report, "image", key, scale)
        for name, (xs, ys) in lines.items():
            ax.plot(xs, ys, label=f"{name}, image requests", **STYLE.get(name, {}))
        for workload, (level, value) in mix_points(report, "orchard", key, scale).items():
            ax.plot([level], [value], label=f"orchard, {workload} (median)", **MIX_STYLE[workload])
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({x for xs, _ in lines.values() for x in xs}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    images = report.get("images") or {}
    gen = ((report.get("settings") or {}).get("load") or {}).get("gen_tokens")
    fig.suptitle(f"{title_of(report)}\none {images.get('width')}x{images.get('height')} image + "
                 f"{images.get('question_tokens')}-token question, {gen} new tokens, streamed over HTTP", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_main(argv: Optional[list[str]] = None) -> list[Path]:
    p = argparse.ArgumentParser(description="PNG plots of a bench.serving.compare or vision_compare JSON: throughput and TTFT P95 against concurrency, one line per server (needs matplotlib)")
    p.add_argument("json", help="a bench.serving.compare or vision_compare report")
    p.add_argument("--out", default=None, help="output folder (default: next to the JSON)")
    args = p.parse_args(argv)
    src = Path(args.json)
    report = json.loads(src.read_text())
    out = Path(args.out) if args.out else src.parent
    out.mkdir(parents=True, exist_ok=True)
    written = []
    if report.get("kind") == "vision":
        path = out / f"{src.stem}.png"
        if plot_vision(report, path):
            print(f"wrote {path}")
            return [path]
        return []
    for key, ylabel, suffix, scale, engine in (
        ("system_tok_s", "system tokens/s (all streams)", "throughput", 1.0, True),
        ("ttft_p95_s", "TTFT P95 (ms)", "ttft_p95", 1e3, False),
    ):
        path = out / f"{src.stem}_{suffix}.png"
        if plot_metric(report, key, ylabel, path, scale, engine):
            written.append(path)
            print(f"wrote {path}")
    return written


if __name__ == "__main__":
    plot_main()
