"""The ingress app over real in-process engines (LocalBackend, engines on threads), reached through httpx's ASGI
transport."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator

import httpx
from fastapi import FastAPI

from deployments.config import DEFAULT_MAX_BODY_BYTES, ModelConfig
from deployments.ingress.auth import ApiKeys
from deployments.ingress.routes import create_app
from deployments.ingress.local_models import LocalBackend
from deployments.model.service import EngineClientFactory, thread_engine_client
from deployments.ingress.model_registry import Registry
from deployments.ingress.model_store import ModelStore


@dataclass
class LocalStack:
    http: httpx.AsyncClient
    registry: Registry
    backend: LocalBackend
    app: FastAPI  # for clients built on httpx2 (the anthropic SDK)


@contextlib.asynccontextmanager
async def local_stack(
    configs: list[ModelConfig],
    state_dir: Path | None = None,
    new_engine_client: EngineClientFactory = thread_engine_client,
    restore: bool = True,
    model_roots: list[str] | None = None,
    keys: ApiKeys | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> AsyncIterator[LocalStack]:
    """Models of `configs` start as if from serve_config.yaml; `state_dir` holds API-loaded ones. Admin loads take
    folders under `model_roots` only (None: Orchard's and Hugging Face's caches); the ingress is named
    LOCAL_INGRESS_APP."""
    backend = LocalBackend(new_engine_client)
    for config in configs:
        await backend.deploy(config)
    store = ModelStore(state_dir) if state_dir is not None else None
    registry = Registry(backend, store, model_roots, poll_interval_s=0.2)
    await registry.start(restore=restore)
    app = create_app(registry, keys=keys, max_body_bytes=max_body_bytes)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://orchard", timeout=30) as http:
            yield LocalStack(http, registry, backend, app)
    finally:
        await registry.close()
        await backend.close()


def slow_engine_client(delay_s: float) -> EngineClientFactory:
    """A real engine whose start takes `delay_s` longer, to observe a model while it loads."""

    def build(config: ModelConfig):
        engine = thread_engine_client(config)
        start = engine.start

        async def slow_start() -> None:
            await asyncio.sleep(delay_s)
            await start()

        engine.start = slow_start  # type: ignore[method-assign]
        return engine

    return build


async def wait_for(condition, timeout_s: float = 10.0, interval_s: float = 0.05):
    """Async poll until condition() (a coroutine function) returns something truthy."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        value = await condition()
        if value:
            return value
        if loop.time() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s")
        await asyncio.sleep(interval_s)
