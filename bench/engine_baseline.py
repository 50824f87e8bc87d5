"""The in-process engine rate for bench.compare: bench.engine_throughput's orchard column, JSON after every level.

    python -m bench.engine_baseline --model PATH --levels 1,8,64 --prompt-tokens 128 --gen-tokens 128 --json out.json

Run as a child process so its MLX memory is gone before or after the servers run, and so a
time limit can stop it while the levels already measured stay in the JSON.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Optional

from bench.engine_throughput import OrchardRunner, bench_level, free_memory, machine_info, model_info


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--levels", default="1,8,32,64,128")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--warmup-tokens", type=int, default=16)
    p.add_argument("--prefill-batch-size", type=int, default=8)
    p.add_argument("--prefill-chunk-tokens", type=int, default=2048)
    p.add_argument("--prefix-cache", choices=["on", "off"], default="on", help="as the server runs (on by default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", required=True)
    return p.parse_args(argv)


def _write(path: Path, report: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=2))
    tmp.replace(path)


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    levels = [int(x) for x in args.levels.split(",") if x.strip()]
    path = Path(args.json)
    info = model_info(args.model, None)
    report = {"machine": machine_info(), "model": info, "settings": vars(args), "results": [], "error": None}
    _write(path, report)
    started = time.perf_counter()
    runner = OrchardRunner(args.model, args.prefill_batch_size, args.prefill_chunk_tokens, args.prefix_cache == "on")
    print(f"[engine] loaded in {time.perf_counter() - started:.1f} s", flush=True)
    try:
        for concurrency in levels:
            result = bench_level(runner, concurrency, args, info["vocab_size"])
            report["results"].append(asdict(result))
            _write(path, report)
            print(f"  [engine] c={concurrency:<4} {result.tok_per_s:9.1f} tok/s  wall {result.wall_s:6.2f} s  "
                  f"complete {result.complete}", flush=True)
    except Exception as exc:  # the levels measured so far stay in the JSON
        traceback.print_exc()
        report["error"] = f"{type(exc).__name__}: {exc}"
        _write(path, report)
    finally:
        runner.close()
        free_memory()


if __name__ == "__main__":
    main()
