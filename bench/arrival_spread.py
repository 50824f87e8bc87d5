"""When a burst's requests reached the ingress and the model replica, from their log lines (a diagnostic).

    python -m bench.arrival_spread /tmp/ray/session_latest/logs/serve/replica_m_ModelServer_*.log \
        [--ingress-logs /tmp/ray/session_latest/logs/serve/replica_orchard_Ingress_*.log]

The replica logs `request ID (...) started: N prompt tokens` once it has tokenized a request; the ingress logs
`request ID for model ...` once FastAPI has parsed it. Replica lines with at least --min-prompt-tokens tokens are
grouped into bursts (lines less than --gap-s apart); for each burst of at least --burst lines, the last --burst
are kept (the lone requests before it are sent one by one). Printed per burst: milliseconds from the first to the
last arrival at the replica and, given the ingress's logs, at the ingress, and the ingress-to-replica lag (median,
max). bench.serving sends a burst at once (or --burst-stagger-ms apart): a spread at the ingress is the proxy's
and the ingress's own queueing; the lag is the handle call, the replica's event loop and tokenization.
"""

from __future__ import annotations

import argparse
import datetime
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

STARTED = re.compile(r"(\d\d:\d\d:\d\d,\d+) .*request (\S+) \(.*\) started: (\d+) prompt tokens")
AT_INGRESS = re.compile(r"(\d\d:\d\d:\d\d,\d+) .*request (\S+) for model ")


@dataclass
class Arrival:
    request_id: str
    at: datetime.datetime


def _time(text: str) -> datetime.datetime:
    return datetime.datetime.strptime(text, "%H:%M:%S,%f")


def replica_arrivals(log: Path, min_prompt_tokens: int) -> list[Arrival]:
    arrivals = []
    for line in log.read_text(errors="replace").splitlines():
        match = STARTED.search(line)
        if match and int(match.group(3)) >= min_prompt_tokens:
            arrivals.append(Arrival(match.group(2), _time(match.group(1))))
    return arrivals


def ingress_arrivals(logs: list[Path]) -> dict[str, datetime.datetime]:
    found = {}
    for log in logs:
        for line in log.read_text(errors="replace").splitlines():
            match = AT_INGRESS.search(line)
            if match:
                found[match.group(2)] = _time(match.group(1))
    return found


def bursts(arrivals: list[Arrival], burst: int, gap_s: float) -> list[list[Arrival]]:
    groups: list[list[Arrival]] = []
    for arrival in arrivals:
        if not groups or (arrival.at - groups[-1][-1].at).total_seconds() > gap_s:
            groups.append([])
        groups[-1].append(arrival)
    return [group[-burst:] for group in groups if len(group) >= burst]


def _ms(delta: datetime.timedelta) -> float:
    return round(delta.total_seconds() * 1e3, 1)


def describe(group: list[Arrival], at_ingress: dict[str, datetime.datetime]) -> str:
    text = f"replica spread {_ms(group[-1].at - group[0].at)} ms"
    ingress = [at_ingress[a.request_id] for a in group if a.request_id in at_ingress]
    if len(ingress) == len(group):
        lags = [_ms(a.at - at_ingress[a.request_id]) for a in group]
        text += (f", ingress spread {_ms(max(ingress) - min(ingress))} ms, ingress->replica lag median "
                 f"{statistics.median(lags)} max {max(lags)} ms")
    return text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("logs", nargs="+", type=Path, help="the model replica's logs")
    p.add_argument("--ingress-logs", nargs="*", type=Path, default=[])
    p.add_argument("--burst", type=int, default=32)
    p.add_argument("--min-prompt-tokens", type=int, default=400)
    p.add_argument("--gap-s", type=float, default=0.5)
    args = p.parse_args()
    at_ingress = ingress_arrivals(args.ingress_logs)
    for log in args.logs:
        groups = bursts(replica_arrivals(log, args.min_prompt_tokens), args.burst, args.gap_s)
        print(f"{log.name}: bursts {len(groups)}")
        for group in groups:
            print("  " + describe(group, at_ingress))


if __name__ == "__main__":
    main()
