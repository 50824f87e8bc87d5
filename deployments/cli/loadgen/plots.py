"""PNG plots of serving results against concurrency, one line per server: `orchard bench`'s and
bench.serving.compare's (bench/plots.py draws vision_compare's and is the command for a saved JSON)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

SWEEPS = ("mixed", "uniform", "same")
STYLE = {"orchard": dict(color="tab:green", marker="o"), "mlx_lm": dict(color="tab:blue", marker="s"),
         "mlx_vlm": dict(color="tab:blue", marker="s"),
         "engine (in-process)": dict(color="gray", marker="x", linestyle="--")}


def series(report: dict, workload: str, key: str, scale: float = 1.0) -> dict[str, tuple[list[int], list[float]]]:
    """server -> (levels, values) for one workload; missing or null values are left out."""
    out = {}
    for server, suite in (report.get("servers") or {}).items():
        rows = sorted((l["concurrency"], l[key]) for l in (suite or {}).get("levels") or []
                      if l["workload"] == workload and l.get(key) is not None)
        if rows:
            out[server] = ([c for c, _ in rows], [v * scale for _, v in rows])
    return out


def engine_series(report: dict) -> Optional[tuple[list[int], list[float]]]:
    rows = sorted((r["concurrency"], r["tok_per_s"]) for r in (report.get("engine") or {}).get("results") or [])
    return ([c for c, _ in rows], [v for _, v in rows]) if rows else None


def title_of(report: dict) -> str:
    model = report.get("model") or {}
    quant = model.get("quantization")
    kind = f"{quant['bits']}-bit" if quant else (model.get("dtype") or "")
    gpu = ((report.get("machine") or {}).get("nvidia_smi") or "").split(",")[0] or (report.get("machine") or {}).get("default_device", "")
    commit = (report.get("git_commit") or "")[:8]
    return f"{model.get('random_shape') or model.get('model_type')} {kind} · {gpu} · {commit} · {report.get('date', '')[:10]}"


def plot_metric(report: dict, key: str, ylabel: str, path: Path, scale: float = 1.0, with_engine: bool = False) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(w, series(report, w, key, scale)) for w in SWEEPS]
    panels = [(w, s) for w, s in panels if s]
    if not panels:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2), squeeze=False)
    for ax, (workload, lines) in zip(axes[0], panels):
        if with_engine and workload == "uniform" and (engine := engine_series(report)):
            lines = {**lines, "engine (in-process)": engine}
        for name, (xs, ys) in lines.items():
            ax.plot(xs, ys, label=name, **STYLE.get(name, {}))
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({x for xs, _ in lines.values() for x in xs}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(ylabel)
        ax.set_title(workload)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title_of(report), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
