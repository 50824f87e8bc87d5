"""Does CPU work in other processes slow the engine's steps? (a diagnostic)

    python -m bench.contention_probe --model PATH --levels 64 --burners 0,3,6 --rounds 3

A bench.engine_baseline --on-demand child runs the same level again and again while 0, 3 or 6 burner
processes (Python interpreters doing JSON and dict work, like the proxy, ingress and replica under load) run
beside it, in alternating order. Prints the level's tok/s and mean step ms (wall and engine-thread CPU) per case.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
from pathlib import Path

from bench.efficiency_rounds import EngineChild


def burn() -> None:
    payload = {"id": "chatcmpl-x", "choices": [{"delta": {"content": " t12 t400 t9"}, "index": 0}], "n": list(range(64))}
    while True:
        text = json.dumps(payload)
        payload = json.loads(text)
        payload["n"] = [x + 1 for x in payload["n"]][:64]


def run_case(child: EngineChild, level: int, burners: int) -> dict:
    procs = [mp.get_context("spawn").Process(target=burn, daemon=True) for _ in range(burners)]
    for p in procs:
        p.start()
    try:
        return child.run_level(level, timeout_s=300)
    finally:
        for p in procs:
            p.terminate()
            p.join()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--level", type=int, default=64)
    p.add_argument("--burners", default="0,3,6")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--log", default="/tmp/contention_engine.log")
    p.add_argument("--json")
    args = p.parse_args()
    argv = [sys.executable, "-m", "bench.engine_baseline", "--model", args.model, "--stagger-ms", "2",
            "--json", "/tmp/contention_baseline.json"]
    child = EngineChild(argv, Path.cwd(), Path(args.log))
    child.wait_ready(300)
    child.run_level(args.level, timeout_s=300)  # warm-up level
    cases = [int(b) for b in args.burners.split(",")]
    results: dict[int, list[dict]] = {b: [] for b in cases}
    for r in range(args.rounds):
        order = cases if r % 2 == 0 else list(reversed(cases))
        for b in order:
            rec = run_case(child, args.level, b)
            results[b].append(rec)
            print(f"round {r + 1} burners {b}: {rec['tok_per_s']:.1f} tok/s, step {rec['step_ms_mean']:.2f} ms "
                  f"(thread CPU {rec['step_cpu_ms_mean']:.2f})", flush=True)
    child.close()
    for b in cases:
        rates = [x["tok_per_s"] for x in results[b]]
        steps = [x["step_ms_mean"] for x in results[b]]
        print(f"burners {b}: median {statistics.median(rates):.1f} tok/s, step {statistics.median(steps):.2f} ms "
              f"of {[round(s, 2) for s in steps]}")
    if args.json:
        Path(args.json).write_text(json.dumps({str(k): v for k, v in results.items()}, indent=1))


if __name__ == "__main__":
    main()
