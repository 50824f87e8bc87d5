"""Prometheus's text format of MetricsSnapshots (the ingress's own and every model's), for GET /metrics."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import accumulate

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from deployments.metrics.families import ALL_SPECS, MetricKind, MetricSpec
from deployments.model_calls import HistogramSample, MetricsSnapshot, Sample

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def render_metrics(snapshots: Iterable[MetricsSnapshot]) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_SnapshotCollector(list(snapshots)))
    return generate_latest(registry)


class _SnapshotCollector(Collector):
    def __init__(self, snapshots: list[MetricsSnapshot]) -> None:
        self._snapshots = snapshots

    def collect(self) -> Iterator[Metric]:
        samples: dict[str, list[Sample]] = {}
        histograms: dict[str, list[HistogramSample]] = {}
        for snapshot in self._snapshots:
            for sample in snapshot.samples:
                samples.setdefault(sample.name, []).append(sample)
            for histogram in snapshot.histograms:
                histograms.setdefault(histogram.name, []).append(histogram)
        for spec in ALL_SPECS:  # the table's order: families come out in a stable order
            if spec.name in samples:
                yield _value_family(spec, samples[spec.name])
            if spec.name in histograms:
                yield _histogram_family(spec, histograms[spec.name])


def _value_family(spec: MetricSpec, samples: list[Sample]) -> Metric:
    # model_name and the spec's own; `replica` where a model has several (a single replica's samples: "")
    names = sorted(set().union(*(s.labels for s in samples)))
    family_type = CounterMetricFamily if spec.kind is MetricKind.COUNTER else GaugeMetricFamily
    family = family_type(spec.full_name, spec.help, labels=names)
    for sample in samples:
        family.add_metric([sample.labels.get(n, "") for n in names], sample.value)
    return family


def _histogram_family(spec: MetricSpec, histograms: list[HistogramSample]) -> Metric:
    names = sorted(set().union(*(h.labels for h in histograms)))
    family = HistogramMetricFamily(spec.full_name, spec.help, labels=names)
    bounds = [str(float(b)) for b in spec.buckets] + ["+Inf"]
    for histogram in histograms:
        cumulative = list(accumulate(histogram.bucket_counts))
        family.add_metric([histogram.labels.get(n, "") for n in names], list(zip(bounds, cumulative)), histogram.sum)
    return family
