"""Tables for serving results: rich when it is installed, plain text otherwise (the GPU image has no rich)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence


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
    rows = [
        [l.workload, str(l.concurrency), str(l.requests), str(l.errors), fmt(l.system_tok_s),
         fmt(l.ttft_mean_s * 1e3), fmt(l.ttft_p50_s * 1e3), fmt(l.ttft_p95_s * 1e3),
         fmt(l.itl_p50_ms, 2), fmt(l.itl_p99_ms, 2), fmt(l.req_tok_s_mean), fmt(l.reads_per_s), fmt(l.tokens_per_read, 2),
         level_note(l)]
        for l in levels
    ]
    return Table(f"[{server}] concurrency sweep (closed loop)", header, rows)


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
