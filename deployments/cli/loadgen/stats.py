"""Summaries of streamed requests (dataclasses, JSON-ready): a sweep level, the long-prompt scenario, a burst.

Inter-token latency (ITL) is per token: servers coalesce several tokens into one SSE write
(ours by time window, mlx_lm.server not at all), so a read that brings n tokens g seconds
after the previous one counts as n samples of g / n. A stall shows up as one long gap
followed by few tokens, so it still dominates P99; a steady coalesced stream does not
look bursty. The first read of a stream (time to first token) is not an ITL sample.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

import numpy as np

from deployments.cli.loadgen.client import EngineCounters, RequestRecord

MAX_ERROR_SAMPLES = 5
SLOW_CONNECT_S = 0.5


def percentile(values: Sequence[float], q: float, weights: Optional[Sequence[float]] = None) -> float:
    """q in [0, 100]; weighted by `weights` if given (lower weighted percentile). NaN when empty."""
    if len(values) == 0:
        return float("nan")
    v = np.asarray(values, dtype=float)
    if weights is None:
        return float(np.percentile(v, q))
    w = np.asarray(weights, dtype=float)
    order = np.argsort(v)
    cum = np.cumsum(w[order])
    idx = int(np.searchsorted(cum, q / 100.0 * cum[-1], side="left"))
    return float(v[order][min(idx, len(v) - 1)])


def itl_samples(
    records: Iterable[RequestRecord], start: float = float("-inf"), end: float = float("inf")
) -> tuple[list[float], list[float]]:
    """(per-token gap seconds, token weights) of reads arriving in [start, end]."""
    values, weights = [], []
    for record in records:
        arrivals = record.arrivals
        for prev, cur in zip(arrivals, arrivals[1:]):
            if start <= cur.at <= end and cur.tokens > 0:
                values.append((cur.at - prev.at) / cur.tokens)
                weights.append(cur.tokens)
    return values, weights


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def _errors(records: Sequence[RequestRecord]) -> tuple[int, list[str]]:
    failed = [r.error for r in records if r.error]
    return len(failed), sorted(set(failed))[:MAX_ERROR_SAMPLES]


@dataclass
class EngineWindow:
    """Our engine between two counter reads around a level: where the steps' time went."""

    steps: int
    step_ms_mean: float  # wall time per engine step (the decode inter-token time while all decode)
    step_cpu_ms_mean: float  # the engine thread's CPU time per step; wall >> CPU: waiting (device or GIL)
    busy_fraction: float  # time inside steps / window
    process_cpus: float  # the model process's CPU seconds per second, all threads (engine, event loop, Ray)
    # A model with several replicas (the fields above sum or average them): each one's generated tok/s.
    replica_tok_s: dict[str, float] = field(default_factory=dict)
    # A vision-language model: images through its batched tower in the window, and the tower's seconds.
    tower_images: int = 0
    tower_s: float = 0.0


def engine_window(before: Optional[EngineCounters], after: Optional[EngineCounters]) -> Optional[EngineWindow]:
    if before is None or after is None or after.steps <= before.steps or after.at <= before.at:
        return None
    steps, wall = after.steps - before.steps, after.at - before.at
    return EngineWindow(
        steps=steps,
        step_ms_mean=1e3 * (after.step_s - before.step_s) / steps,
        step_cpu_ms_mean=1e3 * (after.step_cpu_s - before.step_cpu_s) / steps,
        busy_fraction=(after.step_s - before.step_s) / wall,
        process_cpus=(after.process_cpu_s - before.process_cpu_s) / wall,
        # Replicas seen at both reads (the board's counters are up to a second old, like the window's ends).
        replica_tok_s={r: round((after.replica_tokens[r] - before.replica_tokens[r]) / wall, 1)
                       for r in sorted(set(after.replica_tokens) & set(before.replica_tokens))},
        tower_images=after.tower_images - before.tower_images,
        tower_s=round(after.tower_s - before.tower_s, 4),
    )


@dataclass
class LevelResult:
    """One workload at one concurrency level (closed loop: `concurrency` workers, requests back to back)."""

    workload: str
    concurrency: int
    requests: int = 0
    ok: int = 0
    errors: int = 0
    cancelled: int = 0
    short: int = 0  # finished with fewer tokens than max_tokens (EOS on servers that cannot ignore it)
    slow_connects: int = 0  # TCP connect >= SLOW_CONNECT_S (SYN retransmits: the server's accept backlog overflowed)
    wall_s: float = 0.0
    generated_tokens: float = 0.0
    system_tok_s: float = 0.0  # all generated tokens / (first send -> last end)
    ttft_mean_s: float = float("nan")
    ttft_p50_s: float = float("nan")
    ttft_p95_s: float = float("nan")
    itl_p50_ms: float = float("nan")
    itl_p99_ms: float = float("nan")
    req_tok_s_mean: float = float("nan")  # per request: (tokens - 1) / (last read - first read)
    req_tok_s_p50: float = float("nan")
    reads_per_s: float = 0.0  # network reads carrying text, all streams together
    tokens_per_read: float = float("nan")
    prompt_words_mean: float = float("nan")
    usage_prompt_tokens_mean: Optional[float] = None  # the server's count (image tokens included)
    image_requests: int = 0
    cached_tokens_mean: Optional[float] = None
    error_samples: list[str] = field(default_factory=list)
    note: str = ""  # e.g. "stopped early: time budget"
    engine: Optional[EngineWindow] = None  # our server only


def summarize_level(workload: str, concurrency: int, records: list[RequestRecord], note: str = "") -> LevelResult:
    result = LevelResult(workload, concurrency, note=note)
    if not records:
        return result
    result.requests = len(records)
    result.ok = sum(r.ok for r in records)
    result.errors, result.error_samples = _errors(records)
    result.cancelled = sum(r.cancelled for r in records)
    result.short = sum(1 for r in records if r.ok and r.completion_tokens + 0.5 < r.max_tokens)
    result.slow_connects = sum(1 for r in records if (r.connect_s or 0.0) >= SLOW_CONNECT_S)
    start, end = min(r.sent_at for r in records), max(r.end_at for r in records)
    result.wall_s = end - start
    result.generated_tokens = sum(r.completion_tokens for r in records)
    result.system_tok_s = result.generated_tokens / result.wall_s if result.wall_s > 0 else 0.0
    _fill_latencies(result, records)
    reads = sum(len(r.arrivals) for r in records)
    result.reads_per_s = reads / result.wall_s if result.wall_s > 0 else 0.0
    result.tokens_per_read = result.generated_tokens / reads if reads else float("nan")
    result.prompt_words_mean = float(np.mean([r.prompt_words for r in records]))
    prompt_tokens = [r.usage_prompt_tokens for r in records if r.usage_prompt_tokens is not None]
    result.usage_prompt_tokens_mean = float(np.mean(prompt_tokens)) if prompt_tokens else None
    result.image_requests = sum(1 for r in records if r.images)
    cached = [r.cached_tokens for r in records if r.cached_tokens is not None]
    result.cached_tokens_mean = float(np.mean(cached)) if cached else None
    return result


def _fill_latencies(result: LevelResult, records: list[RequestRecord]) -> None:
    ttfts = [r.ttft_s for r in records if r.ttft_s is not None]
    if ttfts:
        result.ttft_mean_s = float(np.mean(ttfts))
        result.ttft_p50_s = percentile(ttfts, 50)
        result.ttft_p95_s = percentile(ttfts, 95)
    values, weights = itl_samples(records)
    result.itl_p50_ms = _ms(percentile(values, 50, weights))
    result.itl_p99_ms = _ms(percentile(values, 99, weights))
    rates = [
        (r.completion_tokens - r.arrivals[0].tokens) / (r.arrivals[-1].at - r.arrivals[0].at)
        for r in records
        if len(r.arrivals) > 1 and r.arrivals[-1].at > r.arrivals[0].at
    ]
    if rates:
        result.req_tok_s_mean = float(np.mean(rates))
        result.req_tok_s_p50 = percentile(rates, 50)


@dataclass
class LongPromptResult:
    """`background` streams decode; one long prompt arrives; how much do they stall while it is prefilled?

    Windows on the background streams' reads: `before` = decode only (the baseline median), `during` =
    long prompt sent -> its first token (+ a grace for the read that ends the stall), whole = both and after.
    """

    background_streams: int
    long_prompt_words: int
    long_ttft_s: float = float("nan")  # = the prefill window
    itl_p50_ms_before: float = float("nan")
    itl_p99_ms_before: float = float("nan")
    itl_p50_ms_during: float = float("nan")
    itl_p99_ms_during: float = float("nan")
    itl_max_ms_during: float = float("nan")
    itl_p50_ms: float = float("nan")  # whole steady window (before + during + a short tail)
    itl_p99_ms: float = float("nan")
    during_p99_over_p50: float = float("nan")  # acceptance: P99 while prefilling / decode-only median < 4
    p99_over_p50: float = float("nan")  # whole window; depends on how long the window is, so only a hint
    background_tokens: float = 0.0
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    note: str = ""


def _p50_p99(records: list[RequestRecord], start: float, end: float) -> tuple[float, float, list[float]]:
    values, weights = itl_samples(records, start, end)
    return _ms(percentile(values, 50, weights)), _ms(percentile(values, 99, weights)), values


def summarize_long(
    background: list[RequestRecord], long: Optional[RequestRecord], steady_from: float, long_words: int,
    grace_s: float, note: str = "",
) -> LongPromptResult:
    result = LongPromptResult(len(background), long_words, note=note)
    result.errors, result.error_samples = _errors(background + ([long] if long else []))
    result.background_tokens = sum(r.completion_tokens for r in background)
    result.itl_p50_ms, result.itl_p99_ms, _ = _p50_p99(background, steady_from, float("inf"))
    if long is None or long.first_token_at is None:
        return result
    result.long_ttft_s = long.first_token_at - long.sent_at
    result.itl_p50_ms_before, result.itl_p99_ms_before, _ = _p50_p99(background, steady_from, long.sent_at)
    p50, p99, during = _p50_p99(background, long.sent_at, long.first_token_at + grace_s)
    result.itl_p50_ms_during, result.itl_p99_ms_during = p50, p99
    result.itl_max_ms_during = _ms(max(during)) if during else float("nan")
    if result.itl_p50_ms_before > 0:
        result.during_p99_over_p50 = round(result.itl_p99_ms_during / result.itl_p50_ms_before, 3)
    if result.itl_p50_ms > 0:
        result.p99_over_p50 = round(result.itl_p99_ms / result.itl_p50_ms, 3)
    return result


@dataclass
class BurstResult:
    """A lone request's TTFT, then `burst_size` requests sent (almost) at once."""

    burst_size: int
    prompt_words: int
    stagger_ms: float
    slow_connects: int = 0
    lone_ttft_s: float = float("nan")  # median of the lone runs
    lone_ttfts_s: list[float] = field(default_factory=list)
    ttft_mean_s: float = float("nan")
    ttft_p50_s: float = float("nan")
    ttft_p95_s: float = float("nan")
    ttft_max_s: float = float("nan")
    p95_over_lone: float = float("nan")  # acceptance: <= 3
    wall_s: float = 0.0
    system_tok_s: float = 0.0
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    note: str = ""


def summarize_burst(lone: list[RequestRecord], burst: list[RequestRecord], stagger_ms: float, note: str = "") -> BurstResult:
    words = burst[0].prompt_words if burst else 0
    result = BurstResult(len(burst), words, stagger_ms, note=note)
    result.errors, result.error_samples = _errors(lone + burst)
    result.slow_connects = sum(1 for r in burst if (r.connect_s or 0.0) >= SLOW_CONNECT_S)
    result.lone_ttfts_s = [r.ttft_s for r in lone if r.ttft_s is not None]
    if result.lone_ttfts_s:
        result.lone_ttft_s = float(np.median(result.lone_ttfts_s))
    ttfts = [r.ttft_s for r in burst if r.ttft_s is not None]
    if ttfts:
        result.ttft_mean_s = float(np.mean(ttfts))
        result.ttft_p50_s = percentile(ttfts, 50)
        result.ttft_p95_s = percentile(ttfts, 95)
        result.ttft_max_s = float(max(ttfts))
        if result.lone_ttft_s > 0:
            result.p95_over_lone = round(result.ttft_p95_s / result.lone_ttft_s, 3)
    if burst:
        result.wall_s = max(r.end_at for r in burst) - min(r.sent_at for r in burst)
        tokens = sum(r.completion_tokens for r in burst)
        result.system_tok_s = tokens / result.wall_s if result.wall_s > 0 else 0.0
    return result
