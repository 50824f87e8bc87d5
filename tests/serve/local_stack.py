"""The ingress app over real in-process engines (LocalBackend, engines on threads), reached through httpx's ASGI
transport."""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator

import httpx
from fastapi import FastAPI

from deployments.batches.batches import BatchStore
from deployments.batches.files import FileStore
from deployments.config import ModelConfig
from deployments.ingress_config import DEFAULT_MAX_BODY_BYTES, AdminLoadLimits, MediaLimits, RagConfig
from deployments.ingress.auth import ApiKeys
from deployments.ingress.generation import KEEPALIVE_S
from deployments.ingress.routes import create_app
from deployments.ingress.local_models import LocalBackend
from deployments.model.service import EngineClientFactory, thread_engine_client
from deployments.ingress.model_registry import Registry
from deployments.ingress.model_store import ModelStore
from deployments.hub.downloads import DownloadManager
from deployments.mcp.hub import McpHub


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
    keepalive_s: float = KEEPALIVE_S,
    media: MediaLimits | None = None,
    rag: RagConfig | None = None,
    downloads: DownloadManager | None = None,
    load_limits: AdminLoadLimits | None = None,
    mcp: McpHub | None = None,
    memory_budget_bytes: int | None = None,
    on_demand: list[ModelConfig] | None = None,
    auto_load_repos: list[str] | None = None,
    files: FileStore | None = None,
    batches: BatchStore | None = None,
) -> AsyncIterator[LocalStack]:
    """Models of `configs` start as if from serve_config.yaml; `state_dir` holds API-loaded ones. Admin loads take
    folders under `model_roots` only (None: Orchard's and Hugging Face's caches); the ingress is named
    LOCAL_INGRESS_APP. `rag` serves /v1/rag/* (its embedding model must be among `configs`)."""
    backend = LocalBackend(new_engine_client)
    for config in configs:
        await backend.deploy(config)
    store = ModelStore(state_dir) if state_dir is not None else None
    registry = Registry(backend, store, model_roots, poll_interval_s=0.2, downloads=downloads, load_limits=load_limits,
                        memory_budget_bytes=memory_budget_bytes, on_demand=on_demand, auto_load_repos=auto_load_repos)
    await registry.start(restore=restore)
    rag_service = None
    if rag is not None:  # the RAG deployment's service in process, reaching the models through the registry
        from deployments.rag.service import RagService

        rag_service = RagService(rag, registry.route)
    app = create_app(registry, keys=keys, max_body_bytes=max_body_bytes, keepalive_s=keepalive_s, media=media,
                     rag=rag_service, rag_max_upload_bytes=rag.max_upload_bytes if rag is not None else 0, mcp=mcp,
                     files=files, batches=batches)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://orchard", timeout=30) as http:
            yield LocalStack(http, registry, backend, app)
    finally:
        if getattr(app.state, "batch_runner", None) is not None:  # what the lifespan's end does under Serve
            await app.state.batch_runner.close()
            await app.state.batch_client.aclose()
        await app.state.image_loader.aclose()  # httpx's ASGI transport runs no lifespan
        await app.state.mcp.aclose()
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


async def wait_for(condition, timeout_s: float = 60.0, interval_s: float = 0.05):
    """Async poll until condition() (a coroutine function) returns something truthy; the default bound is for a
    hang (a tiny model loads in ~1 s here, far longer on a busy machine)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        value = await condition()
        if value:
            return value
        if loop.time() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s")
        await asyncio.sleep(interval_s)


@dataclass
class SentMessage:
    """One ASGI message of a response as the app sent it: its start (status, headers) or a part of its body."""

    at: float  # the event loop's time when sent
    status: int | None = None
    headers: dict[str, str] | None = None
    body: str = ""


async def send_streaming(app: FastAPI, path: str, body: dict[str, Any]) -> AsyncIterator[SentMessage]:
    """POST `body` to `app` as an ASGI server does, yielding the response's messages the moment the app sends
    them (httpx's ASGI transport hands a response over only once its body is complete). Leaving early is the
    client's disconnect."""
    loop = asyncio.get_running_loop()
    sent: asyncio.Queue[dict] = asyncio.Queue()
    gone = asyncio.Event()
    data = json.dumps(body).encode()
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())],
        "server": ("orchard", 80), "client": ("127.0.0.1", 123),
    }
    requests = [{"type": "http.request", "body": data, "more_body": False}]

    async def receive() -> dict:
        if requests:
            return requests.pop()
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await sent.put({**message, "at": loop.time()})

    serving = asyncio.create_task(app(scope, receive, send))
    try:
        while True:
            message = await sent.get()
            if message["type"] == "http.response.start":
                headers = {k.decode(): v.decode() for k, v in message.get("headers", [])}
                yield SentMessage(message["at"], status=message["status"], headers=headers)
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield SentMessage(message["at"], body=message["body"].decode())
                if not message.get("more_body", False):
                    return
    finally:
        gone.set()
        await serving
