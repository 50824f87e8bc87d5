"""Ingress: the Serve deployment of the HTTP front door; it owns the model registry (one replica)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from fastapi import FastAPI
from ray import serve
from ray.serve.context import _get_global_client

from deployments.ingress_config import IngressConfig
from deployments.mcp.hub import McpHub
from deployments.ingress.auth import ApiKeys, check_admin_exposure
from deployments.ingress.model_registry import Registry
from deployments.ingress.model_store import ModelStore
from deployments.ingress.responses_store import ResponseStore
from deployments.ingress.routes import create_app
from deployments.batches.batches import BatchStore
from deployments.batches.files import FileStore
from deployments.ingress.serve_models import ServeBackend
from deployments.hub.downloads import DownloadManager
from deployments.transport.rag_client import ServeRagClient
from deployments.ray_loopback import keep_replica_grpc_on_loopback

logger = logging.getLogger("ray.serve.orchard")


@serve.deployment(name="Ingress")
@serve.ingress()
class Ingress:
    """The ingress replica: owns the registry; the FastAPI app is built once the registry exists."""

    async def __init__(self, config: dict[str, Any], rag_handle: Any = None) -> None:
        keep_replica_grpc_on_loopback()
        self.config = IngressConfig.model_validate(config)
        self.keys = ApiKeys.from_config(self.config)
        check_admin_exposure(self.config.enable_admin, self.keys, await proxy_bind_host())
        logger.info("ingress starting: %r, admin %s", self.keys, "on" if self.config.enable_admin else "off")
        store = ModelStore(self.config.resolved_state_dir())
        self.registry = Registry(ServeBackend(), store, self.config.model_roots, self.config.status_poll_interval_s,
                                 downloads=DownloadManager(), load_limits=self.config.admin_loads,
                                 memory_budget_bytes=self.config.memory.budget_bytes, on_demand=self.config.on_demand,
                                 auto_load_repos=self.config.auto_load_repos)
        await self.registry.start(restore=self.config.restore_models)
        self.responses = ResponseStore(self.config.responses_store_size, self.config.responses_store_ttl_s,
                                       max_bytes=self.config.responses_store_bytes)
        self.rag = ServeRagClient(rag_handle) if rag_handle is not None else None
        self.mcp = McpHub(self.config.mcp)

    def __serve_build_asgi_app__(self) -> FastAPI:
        rag_limit = self.config.rag.max_upload_bytes if self.config.rag is not None else 0
        state = self.config.resolved_state_dir()
        return create_app(self.registry, self.config.enable_admin, self.keys, self.config.max_body_bytes,
                          responses=self.responses, media=self.config.media_limits(), rag=self.rag,
                          rag_max_upload_bytes=rag_limit, mcp=self.mcp,
                          files=FileStore(state / "files", self.config.max_file_bytes), batches=BatchStore(state / "batches"),
                          batch_headers=_own_key(self.config))

    async def __del__(self) -> None:
        registry = getattr(self, "registry", None)
        if registry is not None:
            with contextlib.suppress(Exception):
                await registry.close()
        mcp = getattr(self, "mcp", None)
        if mcp is not None:
            with contextlib.suppress(Exception):
                await mcp.aclose()  # stdio servers' processes end with their sessions


async def proxy_bind_host() -> str | None:
    """The host Serve's HTTP proxies bind (http_options.host; None: HTTP disabled), from the controller.

    Ray 2.60 has no public API for it: the controller client's http_config is what `serve start` / `serve run`
    gave the proxies (the controller call blocks, hence the thread).
    """
    client = await asyncio.to_thread(_get_global_client)
    return client.http_config.host


def _own_key(config: IngressConfig) -> dict[str, str]:
    """A batch's lines go through the ingress's own routes with its first inference key (none set: none needed)."""
    keys = config.resolved_api_keys()
    return {"Authorization": f"Bearer {keys[0]}"} if keys else {}
