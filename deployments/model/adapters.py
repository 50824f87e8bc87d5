"""A model replica's per-request LoRA adapters: registered (serve_config.yaml's `adapters`, admin loads, and any a
request brings: the ingress checked its folder), loaded into the engine when first named.

The engine holds up to max_loras at once and unloads the least recently used idle one for a new one
(engine/adapters/registry.py); a registered adapter it unloaded loads again when a request names it. With several
replicas Serve's model multiplexing sends a request to a replica that holds its adapter where one does
(deployments/model/deployment.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import AsyncIterator

from deployments.model_calls import AdapterListing, AdapterRef
from engine.client.supervisor import SupervisedEngine
from engine.errors import ModelLoadError, ModelNotFoundError, OrchardError

logger = logging.getLogger("ray.serve.orchard")


class ServiceAdapters:
    def __init__(self, model_id: str, engine: SupervisedEngine, declared: dict[str, str], capacity: int) -> None:
        self._model_id = model_id
        self._engine = engine
        self._capacity = capacity
        self.registered: dict[str, str] = dict(declared)
        self._lock = asyncio.Lock()  # one load at a time: two requests naming a new adapter load it once

    async def start(self) -> None:
        """Load the declared adapters the engine has room for (the rest load when named); a bad one fails the load."""
        for name, path in list(self.registered.items())[: self._capacity]:
            try:
                await self._engine.load_adapter(name, Path(path))
            except OrchardError as exc:
                raise ModelLoadError(f"adapters.{name}: {exc.message}", param=f"adapters.{name}") from None

    def loaded(self) -> list[str]:
        return [adapter.name for adapter in self._engine.adapters]

    def listing(self, error: OrchardError | None = None) -> AdapterListing:
        return AdapterListing(dict(self.registered), self.loaded(), error)

    @contextlib.asynccontextmanager
    async def held(self, ref: AdapterRef) -> AsyncIterator[None]:
        """Inside, the adapter is loaded (now, if it was not; raises why it cannot be) and no other load can
        unload it: submit the request there, and the engine keeps it loaded while the request runs."""
        async with self._lock:
            await self._load(ref.name, ref.path)
            yield

    async def load(self, name: str, path: str) -> AdapterListing:
        """An admin registration: the adapter is loaded now, so that a bad one is refused at once."""
        try:
            async with self._lock:
                await self._load(name, path)
        except OrchardError as exc:
            return self.listing(exc)
        return self.listing()

    async def unload(self, name: str) -> AdapterListing:
        async with self._lock:
            if self.registered.pop(name, None) is None:
                return self.listing(ModelNotFoundError(
                    f"The model '{self._model_id}' has no adapter '{name}'", param="adapter"))
            if name in self.loaded():
                try:
                    await self._engine.unload_adapter(name)
                except OrchardError as exc:
                    return self.listing(exc)
        return self.listing()

    async def _load(self, name: str, path: str) -> None:
        loaded = self.loaded()
        if name in loaded and self.registered.get(name) == path:
            return
        if name in loaded:  # registered again with another folder: its requests in flight finish on the old one
            await self._engine.unload_adapter(name)
        await self._engine.load_adapter(name, Path(path))
        self.registered[name] = path
