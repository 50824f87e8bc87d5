"""When a burst's requests reached the model replica: the spread of their `started` log lines (a diagnostic).

    python -m bench.arrival_spread /tmp/ray/session_latest/logs/serve/replica_m_ModelServer_*.log

The replica logs `request ... started: N prompt tokens` once it has tokenized a request. Requests with at
least --min-prompt-tokens tokens are grouped into bursts (lines less than --gap-s apart); for each burst of
at least --burst lines, the last --burst are kept (the lone requests before it are sent one by one) and the
milliseconds from the first to the last arrival are printed. bench.serving sends a burst's 32 requests 2 ms
apart, 62 ms from first to last: whatever the replica shows beyond that, the path before it added.
"""

from __future__ import annotations

import argparse
import datetime
import re
from pathlib import Path

STARTED = re.compile(r"(\d\d:\d\d:\d\d,\d+) .*started: (\d+) prompt tokens")


def arrival_times(log: Path, min_prompt_tokens: int) -> list[datetime.datetime]:
    times = []
    for line in log.read_text(errors="replace").splitlines():
        match = STARTED.search(line)
        if match and int(match.group(2)) >= min_prompt_tokens:
            times.append(datetime.datetime.strptime(match.group(1), "%H:%M:%S,%f"))
    return times


def burst_spreads_ms(times: list[datetime.datetime], burst: int, gap_s: float) -> list[float]:
    groups: list[list[datetime.datetime]] = []
    for t in times:
        if not groups or (t - groups[-1][-1]).total_seconds() > gap_s:
            groups.append([])
        groups[-1].append(t)
    return [
        round((group[-1] - group[-burst]).total_seconds() * 1e3, 1) for group in groups if len(group) >= burst
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("logs", nargs="+", type=Path)
    p.add_argument("--burst", type=int, default=32)
    p.add_argument("--min-prompt-tokens", type=int, default=400)
    p.add_argument("--gap-s", type=float, default=0.5)
    args = p.parse_args()
    for log in args.logs:
        spreads = burst_spreads_ms(arrival_times(log, args.min_prompt_tokens), args.burst, args.gap_s)
        print(f"{log.name}: bursts {len(spreads)}, arrival spread ms {spreads}")


if __name__ == "__main__":
    main()
