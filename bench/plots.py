"""PNG plots from a bench.serving.compare or vision_compare JSON: system throughput and TTFT P95 against
concurrency, one line per server.

    python -m bench.plots results.json --out DIR     # needs matplotlib (run it here)

compare: DIR/<json stem>_throughput.png and DIR/<json stem>_ttft_p95.png, one panel per sweep
workload, log2 x axis; the throughput panel of `uniform` also shows the in-process engine rate.
vision_compare: one DIR/<json stem>.png, throughput and TTFT P95 of the `image` sweep side by side, with our
text_only and image_mix medians at the mix level as single points.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Optional

from deployments.cli.loadgen.plots import STYLE, plot_metric, series, title_of

MIX_STYLE = {"text_only": dict(color="tab:green", marker="^", linestyle="none", fillstyle="none", markersize=9),
             "image_mix": dict(color="tab:olive", marker="D", linestyle="none", markersize=7)}


def mix_points(report: dict, server: str, key: str, scale: float) -> dict[str, tuple[int, float]]:
    """workload -> (level, median over the rounds) of a vision report's text_only / image_mix rounds."""
    mix = (report.get("mix") or {}).get(server) or {}
    points = {}
    for workload in MIX_STYLE:
        values = [r[workload][key] * scale for r in mix.get("rounds") or [] if r[workload].get(key) is not None]
        if values:
            points[workload] = (mix["level"], statistics.median(values))
    return points


def plot_vision(report: dict, path: Path) -> bool:
    """Throughput and TTFT P95 of the image sweep, one panel each, in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = (("system_tok_s", "system tokens/s (all streams)", 1.0), ("ttft_p95_s", "TTFT P95 (ms)", 1e3))
    if not series(report, "image", "system_tok_s"):
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    for ax, (key, ylabel, scale) in zip(axes, metrics, strict=True):
        lines = series(report, "image", key, scale)
        for name, (xs, ys) in lines.items():
            ax.plot(xs, ys, label=f"{name}, image requests", **STYLE.get(name, {}))
        for workload, (level, value) in mix_points(report, "orchard", key, scale).items():
            ax.plot([level], [value], label=f"orchard, {workload} (median)", **MIX_STYLE[workload])
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({x for xs, _ in lines.values() for x in xs}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    images = report.get("images") or {}
    gen = ((report.get("settings") or {}).get("load") or {}).get("gen_tokens")
    fig.suptitle(f"{title_of(report)}\none {images.get('width')}x{images.get('height')} image + "
                 f"{images.get('question_tokens')}-token question, {gen} new tokens, streamed over HTTP", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: Optional[list[str]] = None) -> list[Path]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json", help="a bench.serving.compare or vision_compare report")
    p.add_argument("--out", default=None, help="output folder (default: next to the JSON)")
    args = p.parse_args(argv)
    src = Path(args.json)
    report = json.loads(src.read_text())
    out = Path(args.out) if args.out else src.parent
    out.mkdir(parents=True, exist_ok=True)
    written = []
    if report.get("kind") == "vision":
        path = out / f"{src.stem}.png"
        if plot_vision(report, path):
            print(f"wrote {path}")
            return [path]
        return []
    for key, ylabel, suffix, scale, engine in (
        ("system_tok_s", "system tokens/s (all streams)", "throughput", 1.0, True),
        ("ttft_p95_s", "TTFT P95 (ms)", "ttft_p95", 1e3, False),
    ):
        path = out / f"{src.stem}_{suffix}.png"
        if plot_metric(report, key, ylabel, path, scale, engine):
            written.append(path)
            print(f"wrote {path}")
    return written


if __name__ == "__main__":
    main()
