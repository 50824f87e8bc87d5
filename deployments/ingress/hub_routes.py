"""Bodega's model-management routes over the server's DownloadManager (deployments/hub/downloads.py): downloads from the
Hugging Face Hub (plain or as SSE progress), the list of downloads and their cancel, deleting a cached repo; and the
local cache's entries that GET /v1/models adds to the loaded models.

Downloads run on the manager's threads: a request only starts or joins one, so a client that goes away stops
nothing, and two requests for one repo and revision share one transfer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import APIRouter
from fastapi.responses import StreamingResponse

from deployments.api.hub_schemas import (
    DownloadRequest,
    cache_fields,
    cached_model_card,
    download_sse,
    download_state,
    verification_fields,
)
from deployments.api.openapi_errors import (
    ADMIN_LISTING,
    CACHE_DELETE,
    DOWNLOAD_CANCEL,
    DOWNLOAD_START,
    EVENT_STREAM,
    error_responses,
)
from deployments.api.sse import SSE_HEADERS, SSE_KEEPALIVE
from deployments.hub.cache import CachedModel, HubVerification, list_cached_models
from deployments.hub.downloads import DownloadJob, DownloadManager
from deployments.hub.events import Subscription
from deployments.hub.errors import CachedModelInUseError, DownloadNotFoundError
from deployments.ingress.generation import KEEPALIVE_S
from deployments.ingress.model_entries import ModelEntry, ModelStatus
from deployments.ingress.model_registry import Registry
from engine.errors import OrchardError

logger = logging.getLogger("ray.serve.orchard")
CANCEL_WAIT_S = 5.0  # a cancel takes effect at the next chunk received: wait that long to answer its final state


def hub_router(downloads: DownloadManager, registry: Registry, keepalive_s: float = KEEPALIVE_S) -> APIRouter:
    """The admin routes (they write to the disk: the admin key's, see ingress/auth.py)."""
    router = APIRouter()

    @router.post("/v1/admin/download-model", status_code=202, responses=error_responses(DOWNLOAD_START))
    async def download_model(body: DownloadRequest) -> dict[str, Any]:
        job = downloads.start(body.repo_id, body.revision, body.token)
        logger.info("download %s of %s@%s (%s)", job.download_id, job.repo_id, job.revision, job.latest.status.value)
        return download_state(job)

    @router.post("/v1/admin/download-model-stream",
                 responses={**EVENT_STREAM, **error_responses(DOWNLOAD_START)})
    async def download_model_stream(body: DownloadRequest) -> StreamingResponse:
        job, subscription = downloads.start_watched(body.repo_id, body.revision, body.token)
        logger.info("download %s of %s@%s streamed", job.download_id, job.repo_id, job.revision)
        return StreamingResponse(_download_events(job, subscription, keepalive_s), media_type="text/event-stream",
                                 headers=SSE_HEADERS)

    @router.get("/v1/admin/downloads", responses=error_responses(ADMIN_LISTING))
    async def list_downloads() -> dict[str, Any]:
        jobs = downloads.downloads()
        return {"object": "list", "data": [download_state(job) for job in jobs], "total": len(jobs)}

    @router.delete("/v1/admin/downloads/{download_id}", responses=error_responses(DOWNLOAD_CANCEL))
    async def cancel_download(download_id: str) -> dict[str, Any]:
        job = downloads.get(download_id)
        if job is None:
            raise DownloadNotFoundError(f"no download '{download_id}' on this server", param="download_id")
        # Its final event goes out before its thread counts it finished: that event says it ended.
        cancelled = not job.latest.final and downloads.cancel(download_id)
        if cancelled:
            try:
                await asyncio.wait_for(job.wait_async(), CANCEL_WAIT_S)
            except TimeoutError:
                pass  # it stops at its next chunk; GET /v1/admin/downloads shows when
        return {**download_state(job), "cancelled": cancelled}

    @router.delete("/v1/models/local/{repo_id:path}", responses=error_responses(CACHE_DELETE))
    async def delete_local_model(repo_id: str) -> dict[str, Any]:
        await _check_not_loaded(registry, downloads, repo_id)
        freed = await asyncio.to_thread(downloads.delete, repo_id)
        logger.info("deleted %s from the Hugging Face cache (%d bytes)", repo_id, freed)
        return {"id": repo_id, "object": "model", "deleted": True, "freed_bytes": freed,
                "freed_gb": round(freed / 1e9, 3)}

    # Bodega documents the route as DELETE /v1/models/{model_id} (its examples use .../local/...): both delete from
    # the cache. Registered after the one above, which Starlette matches first. Admin key: ingress/auth.py.
    router.add_api_route("/v1/models/{repo_id:path}", delete_local_model, methods=["DELETE"],
                         responses=error_responses(CACHE_DELETE), name="delete_cached_model")
    return router


async def _download_events(job: DownloadJob, subscription: Subscription, keepalive_s: float) -> AsyncIterator[str]:
    """The download's events as SSE until its final one; a keep-alive while none comes. Leaving (the client's
    disconnect cancels this generator) ends only this reader."""
    while True:
        try:
            event = await asyncio.wait_for(subscription.get_async(), keepalive_s)
        except TimeoutError:
            yield SSE_KEEPALIVE  # a waiting get leaves its event queued: none is lost
            continue
        yield download_sse(job, event)
        if event.final:
            return


async def _check_not_loaded(registry: Registry, downloads: DownloadManager, repo_id: str) -> None:
    """Refuse to delete a repo a model serves from (loaded by repo id, or from one of its snapshot folders)."""
    repo_folder = downloads.cache_dir / f"models--{repo_id.replace('/', '--')}"
    for entry in await registry.details():
        if entry.status != ModelStatus.FAILED and (_serves_from(entry, repo_id, repo_folder)
                                                   or _serves_from_folded(entry, repo_id)):
            raise CachedModelInUseError(
                f"the model '{entry.model_id}' is {entry.status.value} from '{repo_id}': unload it first",
                param="repo_id")


def _serves_from_folded(entry: ModelEntry, repo_id: str) -> bool:
    """Loaded by the same repo id in another case (the cache's lookups ignore case: hub/cache.py)."""
    return entry.config is not None and entry.config.model_path.casefold() == repo_id.casefold()


def _serves_from(entry: ModelEntry, repo_id: str, repo_folder: Path) -> bool:
    if entry.config is not None and entry.config.model_path == repo_id:
        return True
    folders = [entry.loaded_from, entry.info.model_path if entry.info is not None else None]
    return any(f is not None and Path(f).is_relative_to(repo_folder) for f in folders)


# ---- the local cache in GET /v1/models ---------------------------------------------------------------------
@dataclass
class CacheListing:
    loaded_fields: dict[str, dict[str, Any]]  # model id -> the cache fields of the repo it serves from
    cards: list[dict[str, Any]]  # cached repos, but one a loaded model's id names


async def cache_listing(downloads: DownloadManager, loaded: list[ModelEntry], verify: bool) -> CacheListing:
    """The cached repos (read off the disk on a thread), each matched to the loaded models that serve from it;
    with `verify`, each checked against the Hub at once."""
    cached = await asyncio.to_thread(_scan, downloads)
    checks = await asyncio.gather(*(_verify(downloads, c) for c, _ in cached)) if verify else None
    listing = CacheListing({}, [])
    for index, (model, created) in enumerate(cached):
        fields = cache_fields(model)
        if checks is not None:
            fields.update(verification_fields(*checks[index]))
        repo_folder = model.snapshot_path.parent.parent
        serving = [e for e in loaded if _serves_from(e, model.repo_id, repo_folder)]
        for entry in serving:
            listing.loaded_fields[entry.model_id] = fields
        # Listed under its repo id unless a model of that very id is (Bodega lists the cache: a repo loaded as
        # "raptor" is still downloaded, as "SRSWTI/raptor").
        if model.repo_id not in {e.model_id for e in loaded}:
            card = cached_model_card(model, created, downloads.is_downloading(model.repo_id))
            listing.cards.append({**card, **fields})
    return listing


def _scan(downloads: DownloadManager) -> list[tuple[CachedModel, int]]:
    models = list_cached_models(downloads.cache_dir, downloads.allow_patterns)
    return [(m, _created(m.snapshot_path)) for m in models]


def _created(snapshot: Path) -> int:
    try:
        return int(snapshot.stat().st_mtime)
    except OSError:
        return 0


async def _verify(downloads: DownloadManager, model: CachedModel) -> tuple[HubVerification | None, str | None]:
    revision = "main" if "main" in model.refs else (model.refs[0] if model.refs else model.commit)
    try:
        return await asyncio.to_thread(downloads.verify, model.repo_id, revision), None
    except OrchardError as exc:
        return None, exc.message
    except Exception as exc:  # noqa: BLE001 -- one repo's check must not fail the list
        logger.warning("verifying %s with the Hub failed: %r", model.repo_id, exc)
        return None, f"the Hub could not be asked: {type(exc).__name__}"
