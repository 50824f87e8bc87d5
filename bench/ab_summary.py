"""The summary line per variant of an alternating-rounds A/B (gpu_twin_ab.sh, gpu_ingress_ab.sh):

    python -m bench.ab_summary WORK_DIR LABEL [LABEL ...]

reads WORK_DIR/LABEL_uniform_*.json and WORK_DIR/LABEL_burst_*.json (bench.serving reports) and prints, per label,
the medians of the 64-stream rates and of the bursts' P95 / lone TTFT, P95 and lone TTFT, with every round's value.
"""

from __future__ import annotations

import glob
import json
import statistics
import sys


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def summary_line(work: str, label: str) -> str:
    rates = [level["system_tok_s"] for path in sorted(glob.glob(f"{work}/{label}_uniform_*.json"))
             for level in json.load(open(path))["suite"]["levels"]]
    bursts = [json.load(open(path))["suite"]["burst"] for path in sorted(glob.glob(f"{work}/{label}_burst_*.json"))]
    bursts = [b for b in bursts if b and b.get("ttft_p95_s") and b.get("lone_ttft_s")]
    ratios = [b["ttft_p95_s"] / b["lone_ttft_s"] for b in bursts]
    lone = [b["lone_ttft_s"] * 1000 for b in bursts]
    p95 = [b["ttft_p95_s"] * 1000 for b in bursts]
    return (f"{label}: uniform c=64 tok/s median {median(rates):.1f} of {[round(r) for r in rates]}; burst P95/lone "
            f"median {median(ratios):.2f} of {[round(r, 2) for r in ratios]}; P95 median {median(p95):.1f} ms, "
            f"lone TTFT median {median(lone):.1f} ms")


if __name__ == "__main__":
    for name in sys.argv[2:]:
        print(summary_line(sys.argv[1], name))
