"""`orchard top`: a live terminal monitor of every model a running server holds. It keeps no state on the server:
each refresh reads /metrics, /health and /v1/queue/stats, and rates and percentiles are the difference between
the last two reads."""

from __future__ import annotations

import argparse
import os
import time
from datetime import datetime

import httpx
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from deployments.cli.server_client import (
    DEFAULT_URL,
    ServerUnreachable,
    auth_headers,
    base_url,
    default_url,
)
from deployments.cli.top_stats import ModelRow, Scrape, model_rows, scrape

STATUS_STYLE = {"running": "green", "loading": "yellow", "degraded": "yellow", "restarting": "yellow"}


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("top", help="live monitor of a running server's models (tok/s, latency, memory)",
                            description=__doc__)
    p.add_argument("--url", default=None, help=f"the server (default: $ORCHARD_URL, the one `orchard serve` runs, "
                   f"or {DEFAULT_URL})")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")
    p.add_argument("--once", action="store_true",
                   help="read twice, --interval apart, print one frame and exit (for scripts and screenshots)")
    p.add_argument("--api-key", default=None, help="the server's inference key, if it has keys (default: "
                   "$ORCHARD_API_KEY); without it tok/s counts ended requests only")


def run(args: argparse.Namespace) -> int:
    console = Console()
    if not console.is_terminal and "COLUMNS" not in os.environ:  # piped: rich's 80 columns would squeeze the table
        console.width = 160
    try:
        url = base_url(args.url or default_url())
        if args.interval <= 0:
            raise ValueError(f"--interval must be > 0 (got {args.interval:g})")
    except ValueError as exc:
        console.print(f"[red]orchard top:[/] {exc}")
        return 2
    with httpx.Client(headers=auth_headers(args.api_key), timeout=10.0) as http:
        try:
            first = scrape(http, url)
            if not args.once:
                return _live(console, http, url, first, args.interval)
            time.sleep(args.interval)
            console.print(frame(url, first, scrape(http, url), args.interval))
            return 0
        except ServerUnreachable as exc:
            console.print(f"[red]orchard top:[/] {exc}")
            return 1
        except KeyboardInterrupt:
            return 0


def _live(console: Console, http: httpx.Client, url: str, first: Scrape, interval: float) -> int:
    """Until Ctrl-C (KeyboardInterrupt, caught by run)."""
    before, now = None, first
    with Live(frame(url, before, now, interval), console=console, auto_refresh=False, screen=False) as live:
        while True:
            time.sleep(interval)
            try:
                before, now = now, scrape(http, url)
                live.update(frame(url, before, now, interval), refresh=True)
            except ServerUnreachable as exc:  # keep watching: the server may come back
                live.update(Text(f"{datetime.now():%H:%M:%S}  {exc}", style="red"), refresh=True)


def frame(url: str, before: Scrape | None, now: Scrape, interval: float) -> Group:
    rows = model_rows(before, now)
    health_style = {"ok": "green", "degraded": "yellow"}.get(now.health, "red")
    title = Text.assemble(("orchard top", "bold"), f"  {url}  ", ("health ", "dim"), (now.health, health_style),
                          f"  {len(rows)} model(s)  ", (f"{datetime.now():%H:%M:%S}", "dim"),
                          (f"  every {interval:g} s, Ctrl-C quits", "dim"))
    parts = [title, _table(rows)]
    notes = [Text(f"{row.model_id}: {row.error}", style="red") for row in rows if row.error]
    notes.append(Text("hit: prefix-cache hit rate · KV: running requests' KV cache · prefix: prefix cache · "
                      "MLX: MLX's active memory (weights + caches)", style="dim"))
    if any((not row.ttft_window and row.ttft_p50 is not None) or (not row.itl_window and row.itl_p50 is not None)
           for row in rows):
        notes.append(Text("dim latencies: none in the last refresh, so since the model started", style="dim"))
    return Group(*parts, *notes)


def _table(rows: list[ModelRow]) -> Table:
    table = Table(box=None, header_style="bold cyan", pad_edge=False, collapse_padding=True)
    table.add_column("model", no_wrap=True, max_width=32)
    table.add_column("status", no_wrap=True)
    for name in ("run", "wait", "tok/s", "TTFT ms p50/95/99", "ITL ms p50/99", "hit", "KV", "prefix", "MLX",
                 "RSS", "errors", "restarts"):
        table.add_column(name, justify="right", no_wrap=True)
    for row in rows:
        table.add_row(
            row.model_id, Text(row.status, style=STATUS_STYLE.get(row.status, "red")),
            _count(row.running), _count(row.waiting), _number(row.tokens_per_s),
            Text(_ms(row.ttft_p50, row.ttft_p95, row.ttft_p99), style="" if row.ttft_window else "dim"),
            Text(_ms(row.itl_p50, row.itl_p99, digits=1), style="" if row.itl_window else "dim"),
            _percent(row.prefix_hit_rate), _bytes(row.kv_bytes), _bytes(row.prefix_cache_bytes),
            _bytes(row.mlx_active_bytes), _bytes(row.rss_bytes),
            Text(_count(row.errors), style="red" if row.errors else ""),
            Text(_count(row.engine_restarts), style="red" if row.engine_restarts else ""),
        )
    return table


def _count(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _ms(*seconds: float | None, digits: int = 0) -> str:
    if all(value is None for value in seconds):
        return "-"
    return "/".join("-" if value is None else f"{value * 1e3:.{digits}f}" for value in seconds)


def _percent(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:.0%}"


def _bytes(value: float | None) -> str:
    """Four characters or so: 0, 512B, 12K, 5.6M, 938M, 1.2G."""
    if value is None:
        return "-"
    if value == 0:
        return "0"
    for unit in ("B", "K", "M", "G"):
        if value < 1024 or unit == "G":
            return f"{value:.1f}{unit}" if value < 10 and unit != "B" else f"{value:.0f}{unit}"
        value /= 1024
    return "-"
