"""Tables of serving results (rich when it is installed, plain text otherwise: the GPU image has no rich).

One server's suite (load.py), then several servers side by side from a report read as plain dicts (as in its
JSON): `orchard bench`'s and bench.serving.compare's (bench/serving/reports.py adds compare's acceptance checks).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence

REFERENCE = "mlx_lm"  # side-by-side tables add ours/reference ratios when both servers are in a report
OURS = "orchard"


@dataclass
class Table:
    title: str
    header: list[str]
    rows: list[list[str]]


def fmt(value: Any, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def ratio(num: Optional[float], den: Optional[float], suffix: str = "x") -> str:
    if num is None or den is None or math.isnan(num) or math.isnan(den) or den == 0:
        return "-"
    return f"{num / den:.2f}{suffix}"


def plain(table: Table) -> str:
    rows = [table.header] + table.rows
    widths = [max(len(row[i]) for row in rows) for i in range(len(table.header))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return f"{table.title}\n" + "\n".join(lines)


def show(tables: Sequence[Table]) -> str:
    """Print the tables (rich if available and not disabled by BENCH_PLAIN=1); return them as plain text."""
    text = "\n\n".join(plain(t) for t in tables)
    try:
        if os.environ.get("BENCH_PLAIN"):
            raise ImportError
        from rich.console import Console
        from rich.table import Table as RichTable
    except ImportError:
        print(text, flush=True)
        return text
    console = Console(width=max(160, Console().width))
    for t in tables:
        rich_table = RichTable(title=t.title, title_justify="left")
        for name in t.header:
            rich_table.add_column(name, justify="right")
        for row in t.rows:
            rich_table.add_row(*row)
        console.print(rich_table)
    return text


def level_table(server: str, levels: Sequence[Any]) -> Table:
    header = ["workload", "conc", "reqs", "err", "sys tok/s", "ttft mean ms", "ttft p50 ms", "ttft p95 ms",
              "itl p50 ms", "itl p99 ms", "req tok/s", "reads/s", "tok/read", "note"]
    replicas = any(replica_rates(l) for l in levels)  # a model with several replicas: each one's share
    rows = [
        [l.workload, str(l.concurrency), str(l.requests), str(l.errors), fmt(l.system_tok_s),
         fmt(l.ttft_mean_s * 1e3), fmt(l.ttft_p50_s * 1e3), fmt(l.ttft_p95_s * 1e3),
         fmt(l.itl_p50_ms, 2), fmt(l.itl_p99_ms, 2), fmt(l.req_tok_s_mean), fmt(l.reads_per_s), fmt(l.tokens_per_read, 2),
         level_note(l)] + ([" / ".join(fmt(rate) for rate in replica_rates(l).values())] if replicas else [])
        for l in levels
    ]
    return Table(f"[{server}] concurrency sweep (closed loop)", header + (["replicas tok/s"] if replicas else []), rows)


def replica_rates(level: Any) -> dict[str, float]:
    """Each replica's generated tok/s in the level (our server, a model with several replicas); else empty."""
    engine = getattr(level, "engine", None)
    return dict(getattr(engine, "replica_tok_s", None) or {})


def level_note(level: Any) -> str:
    parts = [level.note] if level.note else []
    if level.short:
        parts.append(f"{level.short} short")
    if getattr(level, "slow_connects", 0):
        parts.append(f"{level.slow_connects} slow connects")
    return "; ".join(parts)


def long_table(results: dict[str, Any]) -> Table:
    header = ["server", "bg streams", "long words", "long ttft ms", "before p50 ms", "before p99 ms",
              "during p50 ms", "during p99 ms", "during max ms", "during p99/before p50", "whole p99/p50", "err", "note"]
    rows = [
        [name, str(r.background_streams), str(r.long_prompt_words), fmt(r.long_ttft_s * 1e3), fmt(r.itl_p50_ms_before, 2),
         fmt(r.itl_p99_ms_before, 2), fmt(r.itl_p50_ms_during, 2), fmt(r.itl_p99_ms_during, 2),
         fmt(r.itl_max_ms_during, 2), fmt(r.during_p99_over_p50, 2), fmt(r.p99_over_p50, 2), str(r.errors), r.note]
        for name, r in results.items() if r is not None
    ]
    return Table("long prompt among running streams: background ITL before / during its prefill", header, rows)


def burst_table(results: dict[str, Any]) -> Table:
    header = ["server", "burst", "prompt words", "lone ttft ms", "ttft mean ms", "ttft p50 ms", "ttft p95 ms",
              "ttft max ms", "p95/lone", "sys tok/s", "err", "note"]
    rows = [
        [name, str(r.burst_size), str(r.prompt_words), fmt(r.lone_ttft_s * 1e3), fmt(r.ttft_mean_s * 1e3),
         fmt(r.ttft_p50_s * 1e3), fmt(r.ttft_p95_s * 1e3), fmt(r.ttft_max_s * 1e3), fmt(r.p95_over_lone, 2),
         fmt(r.system_tok_s), str(r.errors), r.note]
        for name, r in results.items() if r is not None
    ]
    return Table("burst of simultaneous requests vs a lone request", header, rows)


# ---- several servers side by side, from a report
def workload_levels(report: dict, server: str, workload: str) -> dict[int, dict]:
    suite = (report.get("servers") or {}).get(server) or {}
    return {l["concurrency"]: l for l in suite.get("levels") or [] if l["workload"] == workload}


def number(value: Any) -> float:
    """A report's value as a float; NaN for a missing one (null in the JSON)."""
    return float("nan") if value is None else float(value)


def engine_rates(report: dict) -> dict[int, float]:
    engine = report.get("engine") or {}
    return {r["concurrency"]: r["tok_per_s"] for r in engine.get("results") or []}


def sweep_table(report: dict, workload: str) -> Optional[Table]:
    servers = list((report.get("servers") or {}).keys())
    per_server = {s: workload_levels(report, s, workload) for s in servers}
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
        get = lambda s, key: number(per_server.get(s, {}).get(c, {}).get(key))  # noqa: E731  (a server that failed: n/a)
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
