"""What `orchard top` shows, from the server's own endpoints: GET /metrics (Prometheus text), /health and
/v1/queue/stats. Rates and latency percentiles come from the difference between two scrapes."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from deployments.cli.server_client import ServerUnreachable, not_running_message
from deployments.metrics.families import (
    ENGINE_RESTARTS,
    GENERATION_TOKENS,
    ITL,
    KV_CACHE_BYTES,
    MEMORY_BYTES,
    MODEL_LABEL,
    PREFIX_CACHE_BYTES,
    PREFIX_LOOKUPS,
    REQUESTS,
    RUNNING,
    TTFT,
    WAITING,
)


@dataclass
class Histogram:
    """Cumulative bucket counts by upper bound (ascending, +Inf last), as Prometheus exposes them."""

    bounds: list[float] = field(default_factory=list)
    cumulative: list[float] = field(default_factory=list)

    @property
    def count(self) -> float:
        return self.cumulative[-1] if self.cumulative else 0.0

    def minus(self, earlier: Histogram) -> Histogram:
        if earlier.bounds != self.bounds:  # the model restarted with other buckets, or is new: all is recent
            return self
        return Histogram(self.bounds, [a - b for a, b in zip(self.cumulative, earlier.cumulative)])

    def quantile(self, q: float) -> float | None:
        """Prometheus's histogram_quantile: linear within the bucket; the highest finite bound for +Inf."""
        total = self.count
        if total <= 0:
            return None
        rank, lower, below = q * total, 0.0, 0.0
        for bound, cumulative in zip(self.bounds, self.cumulative):
            if cumulative >= rank:
                if math.isinf(bound):
                    return lower
                inside = cumulative - below
                return lower + (bound - lower) * ((rank - below) / inside if inside > 0 else 1.0)
            lower, below = bound, cumulative
        return lower


@dataclass
class ModelMetrics:
    """One model's series from one /metrics page."""

    running: float = 0.0
    waiting: float = 0.0
    kv_bytes: float = 0.0
    prefix_cache_bytes: float = 0.0
    mlx_active_bytes: float | None = None  # weights and caches
    rss_bytes: float | None = None
    requests_error: float = 0.0
    generation_tokens: float = 0.0  # of ended requests
    prefix_hits: float = 0.0
    prefix_misses: float = 0.0
    engine_restarts: float = 0.0
    ttft: Histogram = field(default_factory=Histogram)
    itl: Histogram = field(default_factory=Histogram)


@dataclass
class ModelState:
    """One model as /health and /v1/queue/stats describe it."""

    status: str = "unknown"
    error: str | None = None
    generation_tokens_total: float | None = None  # the engine's own count, in-flight requests included


@dataclass
class Scrape:
    at: float  # time.monotonic()
    health: str  # ok, degraded, unhealthy
    metrics: dict[str, ModelMetrics]
    states: dict[str, ModelState]

    @property
    def model_ids(self) -> list[str]:
        return sorted(set(self.metrics) | set(self.states))


def parse_metrics(text: str) -> dict[str, ModelMetrics]:
    models: dict[str, ModelMetrics] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            model_id = sample.labels.get(MODEL_LABEL)
            if model_id is not None:
                _note_sample(models.setdefault(model_id, ModelMetrics()), sample.name, sample.labels, sample.value)
    return models


# Sample name -> ModelMetrics field, for the series without labels of their own.
_VALUES = {RUNNING.full_name: "running", WAITING.full_name: "waiting", KV_CACHE_BYTES.full_name: "kv_bytes",
           PREFIX_CACHE_BYTES.full_name: "prefix_cache_bytes", GENERATION_TOKENS.full_name: "generation_tokens",
           ENGINE_RESTARTS.full_name: "engine_restarts"}


def _note_sample(model: ModelMetrics, name: str, labels: dict[str, str], value: float) -> None:
    if name in _VALUES:
        setattr(model, _VALUES[name], value)
    elif name == MEMORY_BYTES.full_name and labels.get("kind") in ("mlx_active", "rss"):
        setattr(model, f"{labels['kind']}_bytes", value)
    elif name == REQUESTS.full_name and labels.get("status") == "error":
        model.requests_error += value
    elif name == PREFIX_LOOKUPS.full_name:
        if labels.get("result") == "hit":
            model.prefix_hits = value
        elif labels.get("result") == "miss":
            model.prefix_misses = value
    elif name in (TTFT.full_name + "_bucket", ITL.full_name + "_bucket"):
        histogram = model.ttft if name.startswith(TTFT.full_name) else model.itl
        histogram.bounds.append(float(labels["le"]))
        histogram.cumulative.append(value)


def parse_states(health: dict[str, Any], queue_stats: dict[str, Any] | None) -> dict[str, ModelState]:
    states = {
        row["id"]: ModelState(status=row.get("status") or "unknown", error=row.get("error"))
        for row in health.get("models_detail") or []
    }
    for row in (queue_stats or {}).get("models") or []:
        state = states.setdefault(row["id"], ModelState(status=row.get("status") or "unknown"))
        state.generation_tokens_total = row.get("generation_tokens_total")
    return states


def scrape(http: httpx.Client, url: str) -> Scrape:
    """One read of the three endpoints; /v1/queue/stats may be refused (a key is needed): tok/s then comes from
    ended requests only."""
    try:
        health = http.get(f"{url}/health")
        metrics = http.get(f"{url}/metrics")
        queue = http.get(f"{url}/v1/queue/stats")
    except httpx.ConnectError as exc:
        raise ServerUnreachable(not_running_message(url)) from exc
    except httpx.HTTPError as exc:  # a timeout: the server is there but too busy, or not HTTP
        raise ServerUnreachable(f"{url} did not answer: {type(exc).__name__} {exc}") from exc
    if metrics.status_code != 200 or health.status_code not in (200, 503):
        raise ServerUnreachable(f"{url} answered /metrics {metrics.status_code}, /health {health.status_code}: "
                                "is it an Orchard server?")
    health_body = health.json()
    queue_body = queue.json() if queue.status_code == 200 else None
    return Scrape(time.monotonic(), health_body.get("status", "unknown"), parse_metrics(metrics.text),
                  parse_states(health_body, queue_body))


@dataclass
class ModelRow:
    """One line of the monitor. Latencies in seconds; `ttft_window` / `itl_window` False: no sample between the
    two scrapes, so those percentiles are since the model started."""

    model_id: str
    status: str
    error: str | None = None
    running: float | None = None
    waiting: float | None = None
    tokens_per_s: float | None = None
    ttft_p50: float | None = None
    ttft_p95: float | None = None
    ttft_p99: float | None = None
    itl_p50: float | None = None
    itl_p99: float | None = None
    ttft_window: bool = False
    itl_window: bool = False
    prefix_hit_rate: float | None = None
    kv_bytes: float | None = None
    prefix_cache_bytes: float | None = None
    mlx_active_bytes: float | None = None
    rss_bytes: float | None = None
    errors: float | None = None
    engine_restarts: float | None = None


def model_rows(before: Scrape | None, now: Scrape) -> list[ModelRow]:
    return [_row(model_id, before, now) for model_id in now.model_ids]


def _row(model_id: str, before: Scrape | None, now: Scrape) -> ModelRow:
    state = now.states.get(model_id, ModelState())
    metrics = now.metrics.get(model_id)
    earlier = before.metrics.get(model_id) if before is not None else None
    if metrics is None:  # loading, failed or stopped: nothing measured
        return ModelRow(model_id, state.status, state.error)
    ttft, ttft_window = _recent(metrics.ttft, earlier.ttft if earlier is not None else None)
    itl, itl_window = _recent(metrics.itl, earlier.itl if earlier is not None else None)
    return ModelRow(
        model_id, state.status, state.error, running=metrics.running, waiting=metrics.waiting,
        tokens_per_s=_tokens_per_s(model_id, before, now),
        ttft_p50=ttft.quantile(0.5), ttft_p95=ttft.quantile(0.95), ttft_p99=ttft.quantile(0.99),
        itl_p50=itl.quantile(0.5), itl_p99=itl.quantile(0.99), ttft_window=ttft_window, itl_window=itl_window,
        prefix_hit_rate=_hit_rate(metrics, earlier), kv_bytes=metrics.kv_bytes,
        prefix_cache_bytes=metrics.prefix_cache_bytes, mlx_active_bytes=metrics.mlx_active_bytes,
        rss_bytes=metrics.rss_bytes, errors=metrics.requests_error, engine_restarts=metrics.engine_restarts,
    )


def _recent(histogram: Histogram, earlier: Histogram | None) -> tuple[Histogram, bool]:
    """The samples between the scrapes, or all of them (and False) when there were none."""
    if earlier is not None and (recent := histogram.minus(earlier)).count > 0:
        return recent, True
    return histogram, False


def _tokens_per_s(model_id: str, before: Scrape | None, now: Scrape) -> float | None:
    """The engine's generated tokens between the scrapes (in-flight requests count); else ended requests'."""
    if before is None or now.at <= before.at:
        return None
    elapsed = now.at - before.at
    counts = [s.generation_tokens_total for s in (before.states.get(model_id), now.states.get(model_id)) if s]
    if len(counts) == 2 and None not in counts:
        return max(0.0, counts[1] - counts[0]) / elapsed
    m0, m1 = before.metrics.get(model_id), now.metrics.get(model_id)
    if m0 is None or m1 is None:
        return None
    return max(0.0, m1.generation_tokens - m0.generation_tokens) / elapsed


def _hit_rate(now: ModelMetrics, earlier: ModelMetrics | None) -> float | None:
    """Hits over lookups in the window, or since the start when the window had none."""
    hits, misses = now.prefix_hits, now.prefix_misses
    if earlier is not None and (now.prefix_hits + now.prefix_misses) > (earlier.prefix_hits + earlier.prefix_misses):
        hits, misses = hits - earlier.prefix_hits, misses - earlier.prefix_misses
    return hits / (hits + misses) if hits + misses > 0 else None
