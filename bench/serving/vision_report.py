"""Tables and acceptance checks of a bench.serving.vision_compare report (read as plain dicts, as in its JSON).

Issue 27's goals: ours / mlx_vlm.server system tok/s >= 1.0 at 1 stream and >= 1.5 at 8 and 32 (1.0 below 8,
1.5 from 8 up at other levels); ours with half the requests carrying an image (`image_mix`) >= 0.90 of ours
with text-only requests of about the same tokens (`text_only`) at the mix level, median of the rounds.
"""

from __future__ import annotations

import math
from typing import Optional

from bench.serving.tables import Table, fmt, ratio

OURS = "orchard"
REFERENCE = "mlx_vlm"
MIX_BOUND = 0.90


def throughput_bound(concurrency: int) -> float:
    return 1.0 if concurrency < 8 else 1.5


def _levels(report: dict, server: str, workload: str = "image") -> dict[int, dict]:
    suite = (report.get("servers") or {}).get(server) or {}
    return {lv["concurrency"]: lv for lv in suite.get("levels") or [] if lv["workload"] == workload}


def _num(level: Optional[dict], key: str, scale: float = 1.0) -> float:
    value = (level or {}).get(key)
    return float("nan") if value is None else float(value) * scale


def _counts(level: Optional[dict]) -> str:
    if not level:
        return "-"
    return f"{level['requests']}/{level['errors']}/{level['short']}"


def image_table(report: dict) -> Optional[Table]:
    servers = list((report.get("servers") or {}).keys())
    per_server = {s: _levels(report, s) for s in servers}
    levels = sorted({c for rows in per_server.values() for c in rows})
    if not levels:
        return None
    pair = OURS in servers and REFERENCE in servers
    header = ["conc"] + [f"{s} tok/s" for s in servers] + (["ours/ref tok/s"] if pair else [])
    header += [f"{s} ttft {q} ms" for s in servers for q in ("p50", "p95")] + (["ours/ref ttft p95"] if pair else [])
    header += [f"{s} prompt tok" for s in servers] + [f"{s} reqs/err/short" for s in servers]
    rows = []
    for c in levels:
        at = {s: per_server[s].get(c) for s in servers}
        row = [str(c)] + [fmt(_num(at[s], "system_tok_s")) for s in servers]
        row += [ratio(_num(at.get(OURS), "system_tok_s"), _num(at.get(REFERENCE), "system_tok_s"))] if pair else []
        row += [fmt(_num(at[s], key, 1e3)) for s in servers for key in ("ttft_p50_s", "ttft_p95_s")]
        row += [ratio(_num(at.get(OURS), "ttft_p95_s"), _num(at.get(REFERENCE), "ttft_p95_s"))] if pair else []
        row += [fmt(_num(at[s], "usage_prompt_tokens_mean"), 0) for s in servers] + [_counts(at[s]) for s in servers]
        rows.append(row)
    images = report.get("images") or {}
    what = (f"one {images.get('width')}x{images.get('height')} {images.get('format')} image + "
            f"{images.get('question_tokens')}-token question per request") if images else "image requests"
    return Table(f"image: {what}; system tok/s and TTFT per concurrency level", header, rows)


def mix_table(report: dict) -> Optional[Table]:
    header = ["server", "conc", "round", "text_only tok/s", "image_mix tok/s", "mix/text", "text_only ttft p95 ms",
              "image_mix ttft p95 ms", "images / reqs (mix)", "err"]
    rows = []
    for server, mix in (report.get("mix") or {}).items():
        for r in (mix or {}).get("rounds") or []:
            text, mixed = r["text_only"], r["image_mix"]
            rows.append([server, str(mix["level"]), str(r["round"]), fmt(_num(text, "system_tok_s")),
                         fmt(_num(mixed, "system_tok_s")), fmt(r["ratio"], 3), fmt(_num(text, "ttft_p95_s", 1e3)),
                         fmt(_num(mixed, "ttft_p95_s", 1e3)), f"{mixed['image_requests']} / {mixed['requests']}",
                         str(text["errors"] + mixed["errors"])])
        if mix and mix.get("rounds"):
            rows.append([server, str(mix["level"]), "median", "", "", fmt(mix.get("median_ratio"), 3), "", "", "",
                         mix.get("note") or ""])
    return Table("mixed text + image load vs text-only (alternating rounds)", header, rows) if rows else None


def _check(name: str, value: float, limit: str, passed: Optional[bool]) -> dict[str, str]:
    verdict = "n/a" if passed is None else ("PASS" if passed else "FAIL")
    return {"check": name, "value": fmt(value, 3), "limit": limit, "verdict": verdict}


def vision_checks(report: dict) -> list[dict[str, str]]:
    checks = []
    ours, ref = _levels(report, OURS), _levels(report, REFERENCE)
    for c in sorted(set(ours) & set(ref)):
        a, b = _num(ours[c], "system_tok_s"), _num(ref[c], "system_tok_s")
        value = a / b if b else float("nan")
        bound = throughput_bound(c)
        errors = ours[c]["errors"] + ref[c]["errors"]
        checks.append(_check(f"{OURS} / {REFERENCE} system tok/s, image, c={c}{_failed(errors)}", value, f">= {bound}",
                             None if errors or math.isnan(value) else value >= bound))
    mix = (report.get("mix") or {}).get(OURS) or {}
    if mix.get("rounds"):
        value = _num(mix, "median_ratio")
        each = ", ".join(fmt(r["ratio"], 3) for r in mix["rounds"])
        errors = sum(r[w]["errors"] for r in mix["rounds"] for w in ("text_only", "image_mix"))
        checks.append(_check(f"{OURS} image_mix / text_only system tok/s, c={mix['level']}, median of "
                             f"{len(mix['rounds'])} rounds ({each}){_failed(errors)}", value, f">= {MIX_BOUND}",
                             None if errors or math.isnan(value) else value >= MIX_BOUND))
    return checks


def _failed(errors: int) -> str:
    """A ratio over failed requests means nothing: the check then says so and gives no verdict."""
    return f" [{errors} failed requests]" if errors else ""


def vision_tables(report: dict) -> list[Table]:
    tables = [t for t in (image_table(report), mix_table(report)) if t is not None]
    checks = vision_checks(report)
    if checks:
        rows = [[c["check"], c["value"], c["limit"], c["verdict"]] for c in checks]
        tables.append(Table("issue 27 acceptance (this run)", ["check", "measured", "needs", "verdict"], rows))
    return tables


