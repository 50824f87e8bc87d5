"""Bodega-compatible operational routes: /health, /v1/queue/stats, /v1/admin/{load,unload,loaded}-model(s); and
Orchard's /ready (200 once every model the server knows runs, 503 while one still loads)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from deployments.api.openapi_errors import (
    ADMIN_LISTING,
    ADMIN_LOAD,
    ADMIN_UNLOAD,
    ANY_ROUTE,
    HEALTH_UNHEALTHY,
    LISTING,
    NOT_READY,
    error_responses,
)
from deployments.api.unknown_fields import ignored_field_counts
from deployments.config import ModelConfig
from deployments.model_calls import MemoryUsage, QueueStats, ReplicaQueueStats
from deployments.ingress.model_entries import AdminOperation, ModelEntry, ModelQueueStats, ModelStatus
from engine.errors import ModelLoadError, OrchardError
from engine.spec_decode.speculator import SpeculationStats

if TYPE_CHECKING:
    from deployments.ingress.model_registry import Registry


def admin_router(registry: "Registry", enable_admin: bool = True) -> APIRouter:
    router = APIRouter()

    @router.get("/health", responses={**HEALTH_UNHEALTHY, **error_responses(ANY_ROUTE)})
    async def health() -> JSONResponse:
        body = health_body(await registry.details())
        return JSONResponse(body, status_code=503 if body["status"] == "unhealthy" else 200)

    @router.get("/ready", responses={**NOT_READY, **error_responses(ANY_ROUTE)})
    async def ready() -> JSONResponse:
        readiness = Readiness.of(await registry.details())
        return JSONResponse(readiness.body(), status_code=200 if readiness.ready else 503)

    @router.get("/v1/queue/stats", responses=error_responses(LISTING))
    async def queue_stats() -> dict[str, Any]:
        return queue_stats_body(await registry.queue_stats())

    if not enable_admin:
        return router

    @router.post("/v1/admin/load-model", responses=error_responses(ADMIN_LOAD))
    async def load_model(body: ModelConfig, request: Request, wait: bool = True) -> JSONResponse:
        """200 "loaded" once the model serves (Bodega's answer: the model is then "immediately available"), or
        the load's own error; `?wait=false` (or `Prefer: respond-async`): 202 "loading" at once, as Orchard did."""
        entry = await registry.load(body)
        operation = entry.operation
        answer = {"status": entry.status.value, "model_id": entry.model_id, "model_path": body.model_path,
                  "model_type": body.model_type}
        if not _waits(request, wait):
            return JSONResponse(answer, status_code=202)
        await operation.settled.wait()  # a client that leaves does not cancel the load: it runs in the registry
        _raise_if_failed(operation)
        return JSONResponse({**answer, "status": "loaded"})

    @router.delete("/v1/admin/unload-model/{model_id:path}", responses=error_responses(ADMIN_UNLOAD))
    async def unload_model(model_id: str, request: Request, wait: bool = True) -> JSONResponse:
        """200 "unloaded" once the model's memory is freed (its open streams get their drain time first);
        `?wait=false` (or `Prefer: respond-async`): 202 "unloading" at once."""
        entry = await registry.unload(model_id)
        operation = entry.operation
        if not _waits(request, wait):
            return JSONResponse({"status": entry.status.value, "model_id": entry.model_id}, status_code=202)
        await operation.settled.wait()
        _raise_if_failed(operation, OrchardError)  # the backend could not stop it: a server error (500)
        return JSONResponse({"status": "unloaded", "model_id": entry.model_id})

    @router.get("/v1/admin/loaded-models", responses=error_responses(ADMIN_LISTING))
    async def loaded_models() -> dict[str, Any]:
        entries = await registry.details()
        listing = {"object": "list", "data": [loaded_model(e) for e in entries], "total": len(entries)}
        if registry.memory is not None:  # the node's memory budget: what it holds, the latest loads and evictions
            listing["memory_budget"] = registry.memory.describe()
        return listing

    return router


def _waits(request: Request, wait: bool) -> bool:
    """Whether the caller waits for the outcome: not with ?wait=false or RFC 7240's `Prefer: respond-async`."""
    preferences = {p.strip().lower() for p in request.headers.get("prefer", "").split(",")}
    return wait and "respond-async" not in preferences


def _raise_if_failed(operation: AdminOperation, failure_class: type[OrchardError] = ModelLoadError) -> None:
    """A waited-for load or unload that failed answers its own typed error (a missing repo is 404, a bad folder
    400), with the path as the caller sent it."""
    failure = operation.failed_with
    if failure is None:
        return
    if isinstance(failure, OrchardError):
        raise failure
    raise failure_class(f"The operation failed: {failure!r}", param="model_path")


@dataclass(frozen=True)
class Readiness:
    """Whether every model the server knows (serve_config.yaml's, restored and loaded ones) serves: a client that
    waits for the server waits for this, not for /health's "ok" (which some running model already gives)."""

    running: list[str]
    loading: list[str]  # loading or unloading: settles on its own
    failed: list[str]  # failed, or unhealthy (its engine restarting): needs a look, or a retry later

    @classmethod
    def of(cls, entries: list[ModelEntry]) -> "Readiness":
        by_status: dict[str, list[str]] = {"running": [], "loading": [], "failed": []}
        for entry in entries:
            by_status[_READINESS_OF[entry.current_status]].append(entry.model_id)
        return cls(**by_status)

    @property
    def ready(self) -> bool:
        return bool(self.running) and not (self.loading or self.failed)

    def body(self) -> dict[str, Any]:
        return {"ready": self.ready, "running": self.running, "loading": self.loading, "failed": self.failed}


_READINESS_OF = {
    ModelStatus.RUNNING: "running", ModelStatus.DEGRADED: "running",
    ModelStatus.LOADING: "loading", ModelStatus.UNLOADING: "loading",
    ModelStatus.FAILED: "failed", ModelStatus.UNHEALTHY: "failed",
}


def health_body(entries: list[ModelEntry]) -> dict[str, Any]:
    """ok: every model serves normally; degraded: some model's engine is stalled or restarting while another
    serves; unhealthy (503): none serves. `ready` (Orchard's): every model runs (GET /ready says which do not)."""
    if not entries:
        return {"status": "unhealthy", "ready": False, "model_id": None, "model_status": "no_models"}
    statuses = [e.current_status for e in entries]
    serving = [s for s in statuses if s in (ModelStatus.RUNNING, ModelStatus.DEGRADED)]
    troubled = any(s in (ModelStatus.DEGRADED, ModelStatus.UNHEALTHY) for s in statuses)
    status = "unhealthy" if not serving else ("degraded" if troubled else "ok")
    return {
        "status": status,
        "ready": Readiness.of(entries).ready,
        "model_id": ", ".join(e.model_id for e in entries),
        "model_status": f"initialized ({len(serving)} model(s))" if serving else "no_running_models",
        "models_detail": [
            {
                "id": e.model_id,
                "type": _model_type(e),
                "status": e.current_status.value,
                "error": e.current_error,
                "ram_usage_mb": e.info.memory.total_mb if e.info is not None else None,
            }
            for e in entries
        ],
    }


def loaded_model(entry: ModelEntry) -> dict[str, Any]:
    info, config = entry.info, entry.config
    return {
        "id": entry.model_id,
        "type": _model_type(entry),
        # As the load named it (Bodega shows the repo id), not the snapshot folder it resolved to on this server.
        "model_path": config.model_path if config else (info.model_path if info else None),
        "context_length": info.context_length if info else (config.context_length if config else None),
        "created_at": info.created_at if info else entry.seen_at,
        "status": entry.current_status.value,
        "pid": info.pid if info else None,
        "engine_pid": info.engine_pid if info else None,
        # {} until the model reports: Bodega's docs read it as model.get("memory", {}).get(...), which None breaks.
        "memory": _memory(info.memory) if info else {},
        "engine_restarts": info.engine_restarts if info else None,
        "error": entry.current_error,
    }


def _memory(memory: MemoryUsage) -> dict[str, float]:
    # Bodega's key names; the values are MLX's allocator counters (Metal, CUDA or CPU memory).
    return {
        "metal_active_mb": memory.mlx_active_mb,
        "metal_cache_mb": memory.mlx_cache_mb,
        "metal_peak_mb": memory.mlx_peak_mb,
        "rss_mb": memory.rss_mb,
        "total_mb": memory.total_mb,
    }


def _model_type(entry: ModelEntry) -> str:
    if entry.info is not None:
        return entry.info.model_type
    return entry.config.model_type if entry.config is not None else "lm"


def queue_stats_body(rows: list[ModelQueueStats]) -> dict[str, Any]:
    models = [_queue_row(row) for row in rows]
    return {
        "object": "queue_stats",
        "queue_stats": {
            "queue_size": sum(m["waiting"] or 0 for m in models),
            "active_requests": sum(m["running"] or 0 for m in models),
            "models": len(models),
        },
        "models": models,
        # Unknown request fields accepted and ignored since the ingress started ("api.field": requests).
        "ignored_fields": ignored_field_counts(),
    }


# The counts a model's row and each of its replicas' rows give: wire name -> QueueStats field.
_COUNTS = {
    "waiting": "waiting", "running": "running", "decoding": "decoding", "tokens_per_s": "tokens_per_s",
    "prompt_tokens_total": "prompt_tokens_total", "generation_tokens_total": "generation_tokens_total",
    "engine_steps_total": "steps_total", "engine_step_seconds_total": "step_seconds_total",
    "engine_step_cpu_seconds_total": "step_cpu_seconds_total", "process_cpu_seconds_total": "process_cpu_seconds_total",
    "stream_channel_streams_total": "channel_streams_total",
    "vision_tower_images_total": "vision_tower_images_total",
    "vision_tower_seconds_total": "vision_tower_seconds_total",
}


def _counts(stats: QueueStats | None) -> dict[str, Any]:
    return {wire: getattr(stats, name) if stats is not None else None for wire, name in _COUNTS.items()}


def _queue_row(row: ModelQueueStats) -> dict[str, Any]:
    stats = row.stats
    capacity = None
    if stats is not None:
        capacity = stats.queue_size if stats.queue_size is not None else stats.max_num_seqs
    return {
        "id": row.entry.model_id,
        "status": row.entry.current_status.value,
        "queue_capacity": capacity,
        "max_num_seqs": stats.max_num_seqs if stats else None,
        "kv_cache_bytes": stats.kv_cache_bytes if stats else None,
        **_counts(stats),
        "speculation": _speculation_row(stats.speculation) if stats and stats.speculation else None,
        # A model with several replicas: each one as it last reported (the counts above are their sums).
        "replicas": [_replica_row(r) for r in stats.replicas] if stats and stats.replicas else None,
    }


def _replica_row(replica: ReplicaQueueStats) -> dict[str, Any]:
    return {
        "replica_id": replica.replica_id,
        "node_id": replica.node_id,
        "pid": replica.pid,
        "report_age_s": replica.age_s,
        "health": replica.health.status.value if replica.health is not None else None,
        **_counts(replica.stats),
    }


def _speculation_row(speculation: SpeculationStats) -> dict[str, Any]:
    rate = speculation.acceptance_rate
    return {
        "method": speculation.method,
        "verify_steps": speculation.verify_steps,
        "drafted_tokens": speculation.drafted_tokens,
        "accepted_tokens": speculation.accepted_tokens,
        "acceptance_rate": round(rate, 4) if rate is not None else None,
        # What a verifying step costs beyond a plain decode step here (in plain steps), as the draft policy measured it.
        "verify_overhead": round(speculation.verify_overhead, 3) if speculation.verify_overhead is not None else None,
    }
