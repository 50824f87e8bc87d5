"""MetricsRecorder: where a process records its metrics, once for both exports.

Every count, observation and level is kept here as plain numbers (a MetricsSnapshot crosses Ray to the ingress,
whose /metrics renders it: deployments/metrics/exposition.py) and mirrored into Ray's metrics API, which Ray's
dashboard and Prometheus read from each Ray process. Ray's metric objects record nothing where no Ray runs (the
in-process stack), so the same calls serve there.
"""

from __future__ import annotations

import bisect
import threading

from ray.util import metrics as ray_metrics

from deployments.metrics.families import MODEL_LABEL, MetricKind, MetricSpec
from deployments.model_calls import HistogramSample, MetricsSnapshot, Sample


class MetricsRecorder:
    """One model's metrics as one process sees them (its replica's, or the ingress's), labelled model_name."""

    def __init__(self, model_name: str) -> None:
        self._base = {MODEL_LABEL: model_name}
        self._values: dict[tuple[str, tuple[str, ...]], Sample] = {}
        self._histograms: dict[tuple[str, tuple[str, ...]], HistogramSample] = {}
        self._source_totals: dict[tuple[str, tuple[str, ...]], float] = {}  # set_total's last totals
        self._lock = threading.Lock()  # snapshots may be read from another thread than the one recording

    def inc(self, spec: MetricSpec, amount: float = 1, **labels: str) -> None:
        assert spec.kind is MetricKind.COUNTER, spec.name
        if amount <= 0:
            return
        with self._lock:
            self._sample(spec, labels).value += amount
        _ray_metric(spec).inc(amount, tags=self._tags(labels))

    def set(self, spec: MetricSpec, value: float, **labels: str) -> None:
        assert spec.kind is MetricKind.GAUGE, spec.name
        with self._lock:
            self._sample(spec, labels).value = value
        _ray_metric(spec).set(value, tags=self._tags(labels))

    def set_total(self, spec: MetricSpec, total: float, **labels: str) -> None:
        """Bring a counter up to `total`, a count kept elsewhere since some start (the engine's): Ray's counter gets
        the difference; a smaller total than before means that count restarted (a new engine), so all of it is new."""
        key = (spec.name, _label_key(spec, labels))
        with self._lock:
            last = self._source_totals.get(key, 0.0)
            self._source_totals[key] = total
            self._sample(spec, labels)  # a zero is exported before the first count
        self.inc(spec, total - last if total >= last else total, **labels)

    def observe(self, spec: MetricSpec, value: float, times: int = 1, **labels: str) -> None:
        """`times` observations of `value` (Ray's histogram takes them one by one)."""
        assert spec.kind is MetricKind.HISTOGRAM, spec.name
        with self._lock:
            histogram = self._histogram(spec, labels)
            histogram.bucket_counts[bisect.bisect_left(spec.buckets, value)] += times
            histogram.sum += value * times
        ray_histogram, tags = _ray_metric(spec), self._tags(labels)
        for _ in range(times):
            ray_histogram.observe(value, tags=tags)

    def snapshot(self) -> MetricsSnapshot:
        with self._lock:
            return MetricsSnapshot(
                [Sample(s.name, dict(s.labels), s.value) for s in self._values.values()],
                [HistogramSample(h.name, dict(h.labels), list(h.bucket_counts), h.sum)
                 for h in self._histograms.values()],
            )

    # ---- internals ----------------------------------------------------------------------------------
    def _tags(self, labels: dict[str, str]) -> dict[str, str]:
        return {**self._base, **labels}

    def _sample(self, spec: MetricSpec, labels: dict[str, str]) -> Sample:
        key = (spec.name, _label_key(spec, labels))
        sample = self._values.get(key)
        if sample is None:
            sample = self._values[key] = Sample(spec.name, self._tags(labels), 0.0)
        return sample

    def _histogram(self, spec: MetricSpec, labels: dict[str, str]) -> HistogramSample:
        key = (spec.name, _label_key(spec, labels))
        histogram = self._histograms.get(key)
        if histogram is None:
            histogram = HistogramSample(spec.name, self._tags(labels), [0] * (len(spec.buckets) + 1))
            self._histograms[key] = histogram
        return histogram


def _label_key(spec: MetricSpec, labels: dict[str, str]) -> tuple[str, ...]:
    if set(labels) != set(spec.labels):
        raise ValueError(f"metric {spec.name} takes labels {spec.labels}, got {tuple(labels)}")
    return tuple(labels[name] for name in spec.labels)


# Ray's metric objects, one per name in a process (several models share a process in the in-process stack).
_RAY_METRICS: dict[str, ray_metrics.Metric] = {}
_RAY_METRICS_LOCK = threading.Lock()


def _ray_metric(spec: MetricSpec) -> ray_metrics.Metric:
    with _RAY_METRICS_LOCK:
        metric = _RAY_METRICS.get(spec.name)
        if metric is None:
            tag_keys = (MODEL_LABEL, *spec.labels)
            if spec.kind is MetricKind.COUNTER:
                metric = ray_metrics.Counter(spec.ray_name, spec.help, tag_keys)
            elif spec.kind is MetricKind.GAUGE:
                metric = ray_metrics.Gauge(spec.ray_name, spec.help, tag_keys)
            else:
                metric = ray_metrics.Histogram(spec.ray_name, spec.help, list(spec.buckets), tag_keys)
            _RAY_METRICS[spec.name] = metric
        return metric
