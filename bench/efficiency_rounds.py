"""HTTP / in-process engine throughput at one level, in alternating rounds (bench.compare --efficiency-rounds K).

The lent machines drift: an in-process engine ran 14.4 then 18.8 ms steps in two consecutive 64-stream levels
of one process (2026-11-23, eighth session), so a ratio of two rates measured minutes apart says as much about
the drift as about the HTTP path. Here the same `uniform` level runs K times over HTTP against the running server
and K times in a bench.engine_baseline child kept loaded (--on-demand), one after the other; each round's ratio
comes from the same minute, and the check takes their median. The single-pass sweep figures stay as they were.
"""

from __future__ import annotations

import dataclasses
import json
import queue
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.engine_baseline import READY_LINE, ROUND_PREFIX
from bench.serving import run_suite
from bench.serving_workloads import LoadSettings

ENGINE_READY_TIMEOUT_S = 60.0


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
    """bench.engine_baseline --on-demand in a child process: one level per call, its JSON back."""

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
