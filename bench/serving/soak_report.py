"""The soak test's summary (bench/soak.py): counts per outcome, status, model and API; latency quantiles; the
failed answers whole; the verdict and the printed table."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from bench.serving.answers import Answer
from bench.serving.stats import percentile
from bench.serving.tables import Table, fmt

FAILURES = ("server_error", "hung", "stream_error", "invalid", "client_error", "connection_error")
KEPT_FAILURES = 200  # failed answers kept whole in the JSON (all are counted)


def summarize(answers: list[Answer], planned: int, wall_s: float) -> dict[str, Any]:
    outcomes = Counter(a.outcome for a in answers)
    ok = [a for a in answers if a.outcome == "ok"]
    ttfts = [a.ttft_s for a in ok if a.ttft_s is not None]
    failed = [a for a in answers if a.outcome in FAILURES]
    return {
        "planned": planned, "sent": len(answers), "not_started": planned - len(answers), "wall_s": round(wall_s, 1),
        "outcomes": {k: outcomes.get(k, 0) for k in ("ok", "overload", "disconnected", *FAILURES)},
        "statuses": {str(k): v for k, v in sorted(Counter(a.status for a in answers).items(), key=lambda kv: str(kv[0]))},
        "server_errors_5xx": sum(1 for a in answers if a.status is not None and a.status >= 500),
        "latency_s": _quantiles([a.latency_s for a in ok]), "ttft_s": _quantiles(ttfts),
        "latency_s_by_outcome": {k: _quantiles([a.latency_s for a in answers if a.outcome == k]) for k in sorted(outcomes)},
        "latency_s_by_model": {m: _quantiles([a.latency_s for a in ok if a.shape.model == m])
                               for m in sorted({a.shape.model for a in answers})},
        "json_sent": sum(1 for a in answers if a.shape.json_schema),
        "json_checked": sum(1 for a in ok if a.shape.json_schema and a.finish == "stop"),
        "by_model": _outcomes_by(answers, lambda a: a.shape.model),
        "by_api": _outcomes_by(answers, lambda a: a.shape.api + ("/stream" if a.shape.stream else "")),
        "failures": [answer_record(a) for a in failed[:KEPT_FAILURES]],
        "slowest": [answer_record(a) for a in sorted(answers, key=lambda a: -a.latency_s)[:5]],
    }


def _outcomes_by(answers: list[Answer], key: Callable[[Answer], str]) -> dict[str, dict[str, int]]:
    groups: dict[str, Counter] = defaultdict(Counter)
    for a in answers:
        groups[key(a)][a.outcome] += 1
    return {k: dict(v) for k, v in sorted(groups.items())}


def _quantiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p95": None, "max": None}
    return {"p50": round(percentile(values, 50), 4), "p95": round(percentile(values, 95), 4), "max": round(max(values), 4)}


def answer_record(a: Answer) -> dict[str, Any]:
    record = asdict(a)
    record["shape"]["prompt"] = a.shape.prompt[:200]
    record["latency_s"] = round(a.latency_s, 3)
    return record


def verdict(report: dict[str, Any]) -> dict[str, Any]:
    reasons = [f"{report['outcomes'][k]} {k}" for k in FAILURES if report["outcomes"][k]]
    if report["server_errors_5xx"] and not report["outcomes"]["server_error"]:
        reasons.append(f"{report['server_errors_5xx']} 5xx")
    if not report["idle_after"]:
        reasons.append("not idle after the run (running, waiting or KV above baseline): a leak")
    if report["health_after"]["http_status"] != 200:
        reasons.append(f"/health answers {report['health_after']} after the run")
    if report["sent"] == 0:
        reasons.append("no request was sent")
    return {"passed": not reasons, "reasons": reasons}


def _triple(q: dict[str, float | None]) -> str:
    return f"{fmt(q['p50'], 3)} / {fmt(q['p95'], 3)} / {fmt(q['max'], 3)}"


def table(report: dict[str, Any]) -> Table:
    o, lat = report["outcomes"], report["latency_s"]
    rows = [["requests (sent / planned)", f"{report['sent']} / {report['planned']}"],
            ["statuses", ", ".join(f"{k}: {v}" for k, v in report["statuses"].items())],
            ["ok / disconnected / overload (429)", f"{o['ok']} / {o['disconnected']} / {o['overload']}"],
            ["5xx / hung", f"{report['server_errors_5xx']} / {o['hung']}"],
            ["stream errors / invalid / other 4xx / conn errors",
             f"{o['stream_error']} / {o['invalid']} / {o['client_error']} / {o['connection_error']}"],
            ["latency p50 / p95 / max s (ok)", _triple(lat)],
            *[[f"  {model}", _triple(q)] for model, q in report["latency_s_by_model"].items()],
            ["TTFT p50 / p95 s (ok streams)", f"{fmt(report['ttft_s']['p50'], 3)} / {fmt(report['ttft_s']['p95'], 3)}"],
            ["wall s (+ settle s)", f"{report['wall_s']} (+ {report['settle_s']})"]]
    for model, before in report["state_before"].items():
        after = report["state_after"][model]
        states = [f"{s['running']}/{s['waiting']}/{s['kv_cache_bytes']}" for s in (before, after)]
        rows.append([f"{model}: running/waiting/KV bytes", " -> ".join(states)])
    if "serve_log_errors" in report:
        logged = report["serve_log_errors"]
        rows.append(["Serve log ERROR lines / tracebacks", f"{logged['error_lines']} / {logged['tracebacks']}"])
    rows.append(["health before -> after", f"{report['health_before']['status']} -> {report['health_after']['status']}"])
    passed = report["verdict"]["passed"]
    rows.append(["verdict", "PASS" if passed else "FAIL: " + "; ".join(report["verdict"]["reasons"])])
    return Table("soak", ["", "value"], rows)
