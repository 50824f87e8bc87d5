"""The Hugging Face routes' wire shapes (Bodega's): the download request, a download's state (the 202 answer, the
list, and each SSE event's data), and the local cache's entries in GET /v1/models."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from deployments.api.errors import wire_error
from deployments.hub.cache import CachedModel, HubVerification
from deployments.hub.downloads import DownloadJob
from deployments.hub.events import (
    DownloadCompleted,
    DownloadEvent,
    DownloadFailed,
    DownloadProgress,
)



class DownloadRequest(BaseModel):
    """POST /v1/admin/download-model(-stream). `token` (a Hugging Face token for gated or private repos) is used
    for this download only and never echoed or logged; unset, the server's HF_TOKEN applies."""

    model_config = ConfigDict(extra="forbid")

    repo_id: str = Field(min_length=1, max_length=200, description="owner/name (Bodega's docs send it as model_path)")
    revision: str | None = Field(None, min_length=1, max_length=255, description="branch, tag or commit (main)")
    token: str | None = Field(None, min_length=1, max_length=1000)

    @model_validator(mode="before")
    @classmethod
    def _bodega_model_path(cls, body: Any) -> Any:
        """Bodega's documented body names the repo `model_path`; ours `repo_id`. Either, never both."""
        if not isinstance(body, dict) or "model_path" not in body:
            return body
        if "repo_id" in body:
            raise ValueError("'model_path' and 'repo_id' name the same repo: give one")
        body = dict(body)
        body["repo_id"] = body.pop("model_path")
        return body


def download_state(job: DownloadJob, event: DownloadEvent | None = None) -> dict[str, Any]:
    """A download as one JSON object: where it stands (`event`, else its latest), and how it ended once final."""
    event = event if event is not None else job.latest
    state: dict[str, Any] = {
        "object": "model.download",
        "download_id": job.download_id,
        "repo_id": job.repo_id,
        "revision": job.revision,
        "status": event.status.value,
        "progress": event.percent,
        "started_at": int(job.started_at),
    }
    if isinstance(event, DownloadProgress):
        state.update(
            current_file=event.current_file, bytes_downloaded=event.bytes_done, bytes_total=event.bytes_total,
            files_done=event.files_done, files_total=event.files_total,
            speed_bytes_per_s=event.speed_bytes_per_s, eta_s=event.eta_s)
    elif isinstance(event, DownloadCompleted):
        state.update(
            current_file=None, bytes_downloaded=event.bytes_total, bytes_total=event.bytes_total,
            files_done=event.files_total, files_total=event.files_total, commit=event.commit,
            snapshot_path=str(event.snapshot_path), bytes_fetched=event.bytes_downloaded, elapsed_s=event.elapsed_s)
    elif isinstance(event, DownloadFailed):
        wire = wire_error(event.error)
        state.update(bytes_downloaded=event.bytes_done, bytes_total=event.bytes_total,
                     error={**wire.body["error"], "status_code": wire.status})
    return state


def download_sse(job: DownloadJob, event: DownloadEvent) -> str:
    """One SSE event: `progress` while it runs, then `completed`, or `error` (failed or cancelled)."""
    name = "completed" if isinstance(event, DownloadCompleted) else "error" if event.final else "progress"
    data = json.dumps(download_state(job, event), ensure_ascii=False, separators=(",", ":"))
    return f"event: {name}\ndata: {data}\n\n"


def cache_fields(cached: CachedModel) -> dict[str, Any]:
    """Bodega's cache fields of a repo (a loaded model served from the cache carries them too)."""
    return {"size_gb": cached.size_gb, "download_percentage": cached.download_percentage,
            "is_complete": cached.is_complete}


def cached_model_card(cached: CachedModel, created: int, downloading: bool) -> dict[str, Any]:
    """A cached repo as an entry of OpenAI's model list, owned by the repo's owner (as Bodega lists it)."""
    return {"id": cached.repo_id, "object": "model", "created": created, "owned_by": cached.repo_id.split("/")[0],
            "status": "downloading" if downloading else "cached", **cache_fields(cached)}


def verification_fields(found: HubVerification | None, error: str | None) -> dict[str, Any]:
    """What `?verify_with_hub=true` found for one repo; a Hub that could not answer is a note, never a failure."""
    if found is None:
        return {"is_latest": None, "missing_files": None, "hub_commit": None, "hub_error": error}
    return {"is_latest": found.is_latest, "missing_files": list(found.missing_files), "hub_commit": found.hub_commit,
            "hub_error": None}
