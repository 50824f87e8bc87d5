"""Ingress: the Serve deployment of the HTTP front door; it owns the model registry (one replica)."""

from __future__ import annotations

import contextlib
from typing import Any

from fastapi import FastAPI
from ray import serve

from deployments.config import IngressConfig
from deployments.ingress.model_registry import Registry
from deployments.ingress.model_store import ModelStore
from deployments.ingress.routes import create_app
from deployments.ingress.serve_models import ServeBackend


@serve.deployment(name="Ingress")
@serve.ingress()
class Ingress:
    """The ingress replica: owns the registry; the FastAPI app is built once the registry exists."""

    async def __init__(self, config: dict[str, Any]) -> None:
        self.config = IngressConfig.model_validate(config)
        store = ModelStore(self.config.resolved_state_dir())
        self.registry = Registry(ServeBackend(), store, self.config.model_roots, self.config.status_poll_interval_s)
        await self.registry.start(restore=self.config.restore_models)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return create_app(self.registry, self.config.enable_admin)

    async def __del__(self) -> None:
        registry = getattr(self, "registry", None)
        if registry is not None:
            with contextlib.suppress(Exception):
                await registry.close()
