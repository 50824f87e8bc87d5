"""The replica board: what each replica of a model with several says about itself, for the ingress to read.

Serve's handle routes a call to some replica, so neither a status call nor one stream channel can see every replica
of a model. Here each replica of a model that may have several (config `num_replicas` > 1 or `autoscaling`) reports
once a second to one named Ray actor per cluster: its stream channel's address, its queue stats, metrics and engine
health. The ingress reads the board to spread streams over the replicas' channels itself (replica_routing.py) and
to list health and metrics per replica. A row not refreshed for ROW_TTL_S is dropped: its replica died or was
replaced, and the replacement reports under its own id.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace
from typing import Any, Iterable

import ray

from engine.health import EngineHealth
from deployments.model_calls import MetricsSnapshot, QueueStats, ReplicaQueueStats
from deployments.transport.channel import ChannelAddress

logger = logging.getLogger("ray.serve.orchard")
BOARD_NAME = "orchard-replica-board"
BOARD_NAMESPACE = "orchard"
REPORT_EVERY_S = 1.0
ROW_TTL_S = 5.0  # five missed reports: the replica is gone (a live one reports every second)
READ_TIMEOUT_S = 2.0
ABSENT_RECHECK_S = 5.0  # a model that starts several replicas reaches the ingress's channels this much later at most


@dataclass
class ReplicaReport:
    """One replica's report; `age_s` is set by the board when read (seconds since the report came)."""

    app_name: str
    replica_id: str
    node_id: str
    pid: int
    channel: ChannelAddress | None
    stats: QueueStats | None
    metrics: MetricsSnapshot | None
    health: EngineHealth | None
    age_s: float = 0.0


@ray.remote(num_cpus=0)
class ReplicaBoard:
    """The cluster's rows, keyed by (application, replica id); plain bookkeeping, no calls out."""

    def __init__(self) -> None:
        self._rows: dict[tuple[str, str], tuple[float, ReplicaReport]] = {}

    def report(self, report: ReplicaReport) -> None:
        self._rows[(report.app_name, report.replica_id)] = (time.monotonic(), report)

    def leave(self, app_name: str, replica_id: str) -> None:
        self._rows.pop((app_name, replica_id), None)

    def read(self, app_name: str) -> list[ReplicaReport]:
        now = time.monotonic()
        for key in [k for k, (at, _) in self._rows.items() if now - at > ROW_TTL_S]:
            del self._rows[key]
        return sorted((replace(r, age_s=round(now - at, 3)) for (app, _), (at, r) in self._rows.items() if app == app_name),
                      key=lambda r: r.replica_id)


_handles: dict[str, Any] = {}  # this process's handle to the board, per Ray cluster (GCS address)


def board_handle() -> Any:
    """The cluster's board, started by the first replica that reports (detached: it outlives a replaced replica)."""
    cluster = ray.get_runtime_context().gcs_address
    if cluster not in _handles:
        _handles[cluster] = ReplicaBoard.options(name=BOARD_NAME, namespace=BOARD_NAMESPACE, get_if_exists=True,
                                                 lifetime="detached").remote()
    return _handles[cluster]


_absent_until: dict[str, float] = {}  # per cluster: no board was found; not looked for again before this time


def _existing_board() -> Any | None:
    """The board if a replica started it; a cluster of single-replica models has none (and gets none)."""
    cluster = ray.get_runtime_context().gcs_address
    if cluster not in _handles:
        if time.monotonic() < _absent_until.get(cluster, 0.0):
            return None
        # Listed first: a failed get_actor logs a warning in Ray's worker log. A blocking call to Ray's GCS, so it
        # is made at most every ABSENT_RECHECK_S while there is no board.
        named = ray.util.list_named_actors(all_namespaces=True)
        if not any(a.get("name") == BOARD_NAME and a.get("namespace") == BOARD_NAMESPACE for a in named):
            _absent_until[cluster] = time.monotonic() + ABSENT_RECHECK_S
            return None
        _handles[cluster] = ray.get_actor(BOARD_NAME, namespace=BOARD_NAMESPACE)
    return _handles[cluster]


async def read_board(app_name: str) -> list[ReplicaReport]:
    """The application's live replicas' rows; none when there is no board or it cannot be reached in time."""
    board = _existing_board()
    if board is None:
        return []
    try:
        return await asyncio.wait_for(board.read.remote(app_name), READ_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - the board is best effort: streams fall back to Serve's routing
        logger.warning("replica board unreadable for %s: %r", app_name, exc)
        _handles.clear()  # a board that died is started again at the next call
        return []


# ---- a model's view from its replicas' rows (the ingress's /v1/queue/stats and /metrics)
SUMMED = ("waiting", "running", "decoding", "max_num_seqs", "kv_cache_bytes", "prompt_tokens_total",
          "generation_tokens_total", "tokens_per_s", "steps_total", "step_seconds_total", "step_cpu_seconds_total",
          "process_cpu_seconds_total")


def merged_queue_stats(model_id: str, rows: list[ReplicaReport]) -> QueueStats | None:
    """The model's stats as the sums of its replicas' (each listed in `replicas`); None when none reported any."""
    reported = [row for row in rows if row.stats is not None]
    if not reported:
        return None
    stats = [row.stats for row in reported]
    sums = {name: sum(getattr(s, name) for s in stats) for name in SUMMED}
    queues = [s.queue_size for s in stats]
    return QueueStats(
        model_id=model_id, queue_size=None if None in queues else sum(queues), speculation=None,
        channel_streams_total=_known_sum(s.channel_streams_total for s in stats),
        vision_tower_images_total=_known_sum(s.vision_tower_images_total for s in stats),
        vision_tower_seconds_total=_known_sum(s.vision_tower_seconds_total for s in stats),
        replicas=[ReplicaQueueStats(r.replica_id, r.node_id, r.pid, r.age_s, r.health, r.stats) for r in reported],
        **sums,
    )


def _known_sum(values: Iterable[float | None]) -> Any:
    """The sum of the replicas' values that are known; None where none is."""
    known = [value for value in values if value is not None]
    return sum(known) if known else None


def merged_metrics(rows: list[ReplicaReport]) -> MetricsSnapshot | None:
    """Every replica's samples, each labelled with its replica id (Prometheus sums them per model)."""
    snapshots = [(row.replica_id, row.metrics) for row in rows if row.metrics is not None]
    if not snapshots:
        return None
    return MetricsSnapshot(
        samples=[replace(s, labels={**s.labels, "replica": rid}) for rid, m in snapshots for s in m.samples],
        histograms=[replace(h, labels={**h.labels, "replica": rid}) for rid, m in snapshots for h in m.histograms],
    )


__all__ = ["merged_metrics", "merged_queue_stats", "REPORT_EVERY_S", "ROW_TTL_S", "ReplicaBoard", "ReplicaReport", "board_handle", "read_board"]
