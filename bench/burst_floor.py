"""The lowest burst P95 / lone TTFT any server could reach on a machine, from its bare forwards (a diagnostic).

    python -m bench.burst_floor --parts step_parts.json [--serving serving.json | --lone-ms 29.0]

A burst's P95 request cannot have its first token before the model has run (nearly) all 32 prompts, and a lone
request already pays one prompt's forward. So, whatever the serving path, P95 >= lone + raw(N) - raw(1), where
raw(n) is a bare mlx-lm forward of n prompts (bench.step_parts_probe's `raw_body`; the faster of its cold and warm
figures, so the floor stays a lower bound). The floor ratio is that bound over the lone TTFT. Where the burst's
compute dwarfs a lone request's whole TTFT (a compute-bound prefill, e.g. the 8B shape), no server meets a
small ratio; where it does not (the 0.6B shape on an H100), the gap to the floor is the serving path's to close.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Optional


@dataclass
class BurstFloor:
    rows: int
    tokens: int
    raw_one_ms: float
    raw_burst_ms: float
    lone_ms: float
    measured_p95_ms: float | None

    @property
    def floor_p95_ms(self) -> float:
        return self.lone_ms + self.raw_burst_ms - self.raw_one_ms

    @property
    def floor_ratio(self) -> float:
        return self.floor_p95_ms / self.lone_ms


def fastest_raw_ms(parts: dict, rows: int) -> tuple[float, int]:
    """The faster of the cold and warm bare forwards of `rows` prompts, and their token count."""
    for result in parts["results"]:
        if result["rows"] == rows:
            return min(result["cold"]["raw_body"], result["warm"]["raw_body"]), result["tokens"]
    raise SystemExit(f"no {rows}-row result in the step parts JSON")


def burst_floor(parts: dict, rows: int, lone_ms: float, measured_p95_ms: float | None) -> BurstFloor:
    raw_one, tokens = fastest_raw_ms(parts, 1)
    raw_burst, _ = fastest_raw_ms(parts, rows)
    return BurstFloor(rows, tokens, raw_one, raw_burst, lone_ms, measured_p95_ms)


def measured_burst(serving: dict, server: str) -> tuple[float, float]:
    """A bench.compare report's lone TTFT and burst P95 (ms) for one server."""
    burst = serving["servers"][server]["burst"]
    lone_ms = 1e3 * burst["lone_ttft_s"]
    return lone_ms, lone_ms * burst["p95_over_lone"]


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", required=True, help="bench.step_parts_probe JSON with rows 1 and --rows")
    p.add_argument("--rows", type=int, default=32)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--serving", help="a bench.compare JSON: its lone TTFT and burst P95")
    source.add_argument("--lone-ms", type=float, help="a lone request's TTFT over HTTP")
    p.add_argument("--server", default="orchard")
    args = p.parse_args(argv)
    with open(args.parts) as f:
        parts = json.load(f)
    lone_ms, p95_ms = args.lone_ms, None
    if args.serving:
        with open(args.serving) as f:
            lone_ms, p95_ms = measured_burst(json.load(f), args.server)
    floor = burst_floor(parts, args.rows, lone_ms, p95_ms)
    print(f"{parts.get('shape', '?')}: bare forward {floor.raw_one_ms:.1f} ms (1 x {floor.tokens}), "
          f"{floor.raw_burst_ms:.1f} ms ({floor.rows} x {floor.tokens}); lone TTFT {lone_ms:.1f} ms")
    print(f"  floor: P95 >= {floor.floor_p95_ms:.1f} ms, P95 / lone >= {floor.floor_ratio:.2f}")
    if p95_ms is not None:
        print(f"  measured: P95 {p95_ms:.1f} ms, P95 / lone {p95_ms / lone_ms:.2f} "
              f"({p95_ms / floor.floor_p95_ms:.2f}x the floor)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
