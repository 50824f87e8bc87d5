"""Side-by-side tables and acceptance checks from a bench.compare report (plain dicts, as in its JSON)."""

from __future__ import annotations

from typing import Any, Optional

from bench.serving_stats import BurstResult, LongPromptResult
from bench.serving_tables import Table, burst_table, fmt, long_table, ratio

REFERENCE = "mlx_lm"
OURS = "orchard"
LOCAL = "orchard_local"
HTTP_EFFICIENCY_BOUND = 0.85  # HTTP / in-process engine at 64 streams (the first acceptance point)


def _levels(report: dict, server: str, workload: str) -> dict[int, dict]:
    suite = (report.get("servers") or {}).get(server) or {}
    return {l["concurrency"]: l for l in suite.get("levels") or [] if l["workload"] == workload}


def _num(value: Any) -> float:
    return float("nan") if value is None else float(value)


def engine_rates(report: dict) -> dict[int, float]:
    engine = report.get("engine") or {}
    return {r["concurrency"]: r["tok_per_s"] for r in engine.get("results") or []}


def sweep_table(report: dict, workload: str) -> Optional[Table]:
    servers = list((report.get("servers") or {}).keys())
    per_server = {s: _levels(report, s, workload) for s in servers}
    levels = sorted({c for rows in per_server.values() for c in rows})
    if not levels:
        return None
    pair = OURS in servers and REFERENCE in servers
    engine = engine_rates(report) if workload == "uniform" else {}
    header = ["conc"] + [f"{s} tok/s" for s in servers]
    header += ["ours/ref tok/s"] if pair else []
    header += [f"{s} ttft p95 ms" for s in servers] + (["ours/ref ttft p95"] if pair else [])
    header += [f"{s} itl p50 ms" for s in servers]
    header += ["engine tok/s", "orchard http/engine"] if engine else []
    rows = []
    for c in levels:
        get = lambda s, key: _num(per_server[s].get(c, {}).get(key))  # noqa: E731
        row = [str(c)] + [fmt(get(s, "system_tok_s")) for s in servers]
        row += [ratio(get(OURS, "system_tok_s"), get(REFERENCE, "system_tok_s"))] if pair else []
        row += [fmt(get(s, "ttft_p95_s") * 1e3) for s in servers]
        row += [ratio(get(OURS, "ttft_p95_s"), get(REFERENCE, "ttft_p95_s"))] if pair else []
        row += [fmt(get(s, "itl_p50_ms"), 2) for s in servers]
        if engine:
            rate = engine.get(c, float("nan"))
            row += [fmt(rate), ratio(get(OURS, "system_tok_s"), rate, "")]
        rows.append(row)
    return Table(f"{workload}: system tok/s, TTFT P95, ITL P50 per concurrency level", header, rows)


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


def _efficiency_check(report: dict) -> list[dict[str, str]]:
    """The same ratio from alternating rounds (bench.efficiency_rounds), where the run made them."""
    efficiency = report.get("efficiency") or {}
    rounds = efficiency.get("rounds") or []
    if not rounds:
        return []
    value = _num(efficiency.get("median_ratio"))
    each = ", ".join(fmt(r["ratio"], 3) for r in rounds)
    name = f"{OURS} HTTP / in-process engine, uniform, c={efficiency['level']}, median of {len(rounds)} alternating rounds ({each})"
    return [_check(name, value, f">= {HTTP_EFFICIENCY_BOUND}", None if value != value else value >= HTTP_EFFICIENCY_BOUND)]


def acceptance_checks(report: dict, throughput_workload: str = "mixed") -> list[dict[str, str]]:
    """The issue's acceptance figures as measured in this run (n/a where a side is missing)."""
    checks = []
    engine = engine_rates(report)
    for server in (OURS, LOCAL):  # LOCAL (our HTTP stack without Ray) only tells where the gap lies
        uniform = _levels(report, server, "uniform")
        for c in sorted(set(uniform) & set(engine)):
            if c == 64 or c == max(set(uniform) & set(engine)):
                value = _num(uniform[c].get("system_tok_s")) / engine[c] if engine[c] else float("nan")
                passed = value >= HTTP_EFFICIENCY_BOUND if server == OURS else None
                checks.append(_check(f"{server} HTTP / in-process engine, uniform, c={c}", value,
                                     f">= {HTTP_EFFICIENCY_BOUND}", passed))
    checks += _efficiency_check(report)
    ours, ref = _levels(report, OURS, throughput_workload), _levels(report, REFERENCE, throughput_workload)
    for c in sorted(set(ours) & set(ref)):
        if c in (8, 32, 64) or c == max(set(ours) & set(ref)):
            a, b = _num(ours[c].get("system_tok_s")), _num(ref[c].get("system_tok_s"))
            value = a / b if b else float("nan")
            checks.append(_check(f"orchard / mlx_lm system tok/s, {throughput_workload}, c={c}", value, ">= 1.0", value >= 1.0))
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
