"""The ingress over in-process engines (no Ray) on a loopback port, on a thread of its own: `orchard chat --local`
talks to it over HTTP exactly as to `orchard serve`, and the CLI's tests use it as their real server."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from dataclasses import dataclass, field
from typing import Self

from deployments.config import ModelConfig
from deployments.mcp_config import McpConfig

logger = logging.getLogger(__name__)


@dataclass
class LocalServer:
    configs: list[ModelConfig]
    inference_keys: list[str] = field(default_factory=list)  # none: open, as `orchard chat --local` runs it
    mcp: McpConfig | None = None  # the MCP servers its tool loop may use (none: requests naming one get 400)
    url: str = ""
    error: BaseException | None = None
    _ready: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _loop: asyncio.AbstractEventLoop | None = None
    _stop: asyncio.Event | None = None

    def start(self, timeout_s: float = 300.0) -> LocalServer:
        """Load the models and listen; returns once /health would answer, raises what failed."""
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve()), name="orchard-local", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"the in-process server did not start within {timeout_s:.0f} s")
        if self.error is not None:
            raise self.error
        return self

    def stop(self, timeout_s: float = 60.0) -> None:
        if self._loop is not None and self._stop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(timeout=timeout_s)
            if self._thread.is_alive():  # its engines are stopped at the interpreter's exit (thread_client.py)
                logger.error("the in-process server did not stop within %.0f s", timeout_s)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *_exc_info) -> None:
        self.stop()

    async def _serve(self) -> None:
        # Imported here: uvicorn, FastAPI and the engine are only needed once a local server runs.
        import uvicorn

        from deployments.ingress.auth import ApiKeys
        from deployments.ingress.local_models import LocalBackend
        from deployments.ingress.model_registry import Registry
        from deployments.ingress.routes import create_app
        from deployments.mcp.hub import McpHub

        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        backend = LocalBackend()
        registry = Registry(backend, store=None, model_roots=[], poll_interval_s=0.5)
        try:
            for config in self.configs:
                await backend.deploy(config)
            await registry.start(restore=False)
            listener = socket.create_server(("127.0.0.1", 0))
            self.url = f"http://127.0.0.1:{listener.getsockname()[1]}"
            app = create_app(registry, enable_admin=False, keys=ApiKeys(self.inference_keys), mcp=McpHub(self.mcp))
            server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
            serving = asyncio.create_task(server.serve(sockets=[listener]))
            while not server.started and not serving.done():
                await asyncio.sleep(0.02)
        except BaseException as exc:  # noqa: BLE001 - handed to start(), which raises it in the caller
            self.error = exc
            self._ready.set()
            await registry.close()
            await backend.close()
            return
        self._ready.set()
        await self._stop.wait()
        server.should_exit = True
        await serving
        await registry.close()
        await backend.close()
