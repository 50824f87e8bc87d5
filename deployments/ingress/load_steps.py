"""Steps of an admin load: what it may name, the downloads it waits for, the names it may not take, and its deploy
within the load deadline."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
from pathlib import Path

from deployments.config import ModelConfig, serve_app_name
from deployments.hub.downloads import DownloadManager
from deployments.hub.events import DownloadFailed
from deployments.ingress.model_entries import ModelBackend
from deployments.model_sources import HubFetch, check_admin_model, check_admin_policy, uncached_repos
from engine.errors import InvalidRequestError, ModelLoadError
from engine.images.memory import check_fits
from engine.process_memory import available_memory_bytes

logger = logging.getLogger("ray.serve.orchard")


def check_admin_load(config: ModelConfig, roots: list[str], downloads_first: bool) -> None:
    """What a load may name; a repo to download is checked for what it names only (it is not on disk yet)."""
    check_admin_policy(config, roots)  # first: the repo ids are valid ones
    if not downloads_first:
        resolved = check_admin_model(config, roots)
        if resolved.is_image_model:  # at its smallest default (8 bits): the replica checks again, exactly
            check_fits(config.id, Path(resolved.model_path), config.quantize or 8, available_memory_bytes())


def pending_downloads(config: ModelConfig, downloads: DownloadManager | None) -> list[HubFetch]:
    """The repos (model, draft) to download before the load. Null auto_download downloads too: the admin
    download route already fetches any repo under the same key (Bodega's load-model takes any repo), so only
    an explicit false refuses an uncached one."""
    if config.auto_download is False or downloads is None:
        return []
    return uncached_repos(config)


async def download_for_load(downloads: DownloadManager | None, fetch: HubFetch) -> None:
    """A repo into the hub cache, joining a download of it already running (GET /v1/admin/downloads shows it)."""
    assert downloads is not None
    job = downloads.start(fetch.repo_id, fetch.revision, files=fetch.files)
    logger.info("downloading %s for a load (download %s)", fetch.repo_id, job.download_id)
    final = await job.wait_async()
    if isinstance(final, DownloadFailed):
        error = copy.copy(final.error)  # the download's own stays as GET /v1/admin/downloads shows it
        error.param = fetch.param  # its errors name repo_id; the load's field named the repo
        raise error


async def deploy_within_deadline(backend: ModelBackend, config: ModelConfig, timeout_s: float) -> None:
    """The backend's deploy, failed (and its application deleted) past admin_loads.timeout_s: a replica that cannot
    be placed, or a load that hangs, would otherwise hold the load (and its slot) for good."""
    try:
        await asyncio.wait_for(backend.deploy(config), timeout_s)
    except asyncio.TimeoutError:
        with contextlib.suppress(Exception):
            await backend.undeploy(config.id)
        raise ModelLoadError(
            f"The model did not serve within {timeout_s:g} s (admin_loads.timeout_s): its replica could not be "
            "placed (the resources it asks for are taken) or its start hangs; it was stopped",
            param="model_path") from None


def check_not_reserved(model_id: str, reserved: set[str]) -> None:
    if serve_app_name(model_id) in reserved:
        raise InvalidRequestError(
            f"model_id '{model_id}' is reserved: an application that is not a model (the server's own, or "
            "another Serve application) has that name",
            param="model_id",
        )


__all__ = ["check_admin_load", "check_not_reserved", "deploy_within_deadline", "download_for_load", "pending_downloads"]
