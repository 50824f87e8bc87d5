"""The ingress's view of per-request LoRA adapters: `MODEL:NAME` ids, their folders, admin loads and unloads.

A model's adapters are those its config declares (serve_config.yaml's `adapters`, which its replicas report in
their info; an API-loaded model's config), plus those an admin load added, less those an admin unload removed. A
request's `model: "MODEL:NAME"` routes to MODEL with the adapter's name and folder in its job (AdapterClient), so
that whichever replica takes it can load it; an exact model id always wins over that reading.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Protocol

from deployments.config import check_adapter_name
from deployments.model_calls import AdapterRef, GenerateJob, ModelClient, ModelInfo, StreamChunk
from deployments.model_sources import adapter_folder
from deployments.ingress.model_entries import ModelEntry, ModelStatus
from engine.errors import InvalidRequestError, ModelNotFoundError

SEPARATOR = ":"


def split_adapter_id(model_id: str) -> tuple[str, str] | None:
    """('MODEL', 'NAME') of 'MODEL:NAME', or None when it cannot name an adapter."""
    base, separator, name = model_id.rpartition(SEPARATOR)
    return (base, name) if separator and base and name else None


def checked_adapter_name(name: str) -> str:
    try:
        return check_adapter_name(name)
    except ValueError as exc:
        raise InvalidRequestError(str(exc), param="adapter") from None


@dataclass
class ModelAdapters:
    """One model's adapter changes made through the admin API."""

    added: dict[str, str] = field(default_factory=dict)
    removed: set[str] = field(default_factory=set)


class AdapterCatalog:
    def __init__(self) -> None:
        self._changes: dict[str, ModelAdapters] = {}

    def of(self, entry: ModelEntry) -> dict[str, str]:
        """name -> folder of the model's adapters now."""
        declared: dict[str, str] = {}
        if entry.config is not None:
            declared.update(entry.config.adapters)
        if entry.info is not None:
            declared.update(entry.info.adapters.registered)
        changes = self._changes.get(entry.model_id, ModelAdapters())
        declared.update(changes.added)
        return {name: path for name, path in declared.items() if name not in changes.removed}  # added: never removed

    def ref(self, entry: ModelEntry, name: str) -> AdapterRef | None:
        path = self.of(entry).get(name)
        return AdapterRef(name, path) if path is not None else None

    def added(self, model_id: str, name: str, path: str) -> None:
        changes = self._changes.setdefault(model_id, ModelAdapters())
        changes.added[name] = path
        changes.removed.discard(name)

    def removed(self, entry: ModelEntry, name: str) -> None:
        if name not in self.of(entry):
            raise ModelNotFoundError(f"The model '{entry.model_id}' has no adapter '{name}'", param="adapter")
        changes = self._changes.setdefault(entry.model_id, ModelAdapters())
        changes.added.pop(name, None)
        changes.removed.add(name)

    def forget(self, model_id: str) -> None:
        """The model was unloaded: its admin changes go with it."""
        self._changes.pop(model_id, None)


class AdapterClient:
    """A model's client whose generation jobs run on one of its adapters; everything else is the model's."""

    def __init__(self, client: ModelClient, adapter: AdapterRef) -> None:
        self._client = client
        self._adapter = adapter

    async def generate(self, job: GenerateJob) -> AsyncIterator[StreamChunk]:
        async for chunk in self._client.generate(dataclasses.replace(job, adapter=self._adapter)):
            yield chunk

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


# ---- routing and the admin routes, over the registry ------------------------------------------------------------
class Registry(Protocol):
    """What of the model registry (model_registry.py) adapters use."""

    adapters: AdapterCatalog

    @property
    def model_roots(self) -> list[str]: ...

    def named(self, name: str) -> ModelEntry | None: ...

    async def route(self, model_id: str) -> ModelClient: ...

    async def fetch_info(self, model_id: str) -> ModelInfo | None: ...

    def store_adapters(self, entry: ModelEntry) -> None: ...


async def route_adapter(registry: Registry, base: str, name: str) -> ModelClient:
    """The base model's client with its jobs on adapter `name` (404 if the model has no such adapter)."""
    client = await registry.route(base)
    entry = registry.named(base)
    assert entry is not None  # route() raised otherwise
    ref = await adapter_ref(registry, entry, name)
    if ref is None:
        raise ModelNotFoundError(
            f"The model '{base}{SEPARATOR}{name}' does not exist ('{base}' has no adapter '{name}')", param="model")
    return AdapterClient(client, ref)


async def adapter_ref(registry: Registry, entry: ModelEntry, name: str) -> AdapterRef | None:
    ref = registry.adapters.ref(entry, name)
    if ref is None and entry.source == "config":  # its serve_config.yaml adapters come with its info
        entry.info = await registry.fetch_info(entry.model_id) or entry.info
        ref = registry.adapters.ref(entry, name)
    return ref


async def adapter_cards(registry: Registry, entries: list[ModelEntry]) -> list[tuple[ModelEntry, str]]:
    """(base entry, adapter name) of every adapter of these models (a config model's info fetched once)."""
    missing = [e for e in entries if e.info is None and e.source == "config" and e.status == ModelStatus.RUNNING]
    infos = await asyncio.gather(*(registry.fetch_info(e.model_id) for e in missing))
    for entry, info in zip(missing, infos):
        entry.info = info or entry.info
    return [(entry, name) for entry in entries for name in sorted(registry.adapters.of(entry))]


async def load_adapter(registry: Registry, model_id: str, name: str, path: str) -> AdapterRef:
    """Register a per-request adapter on a serving model and load it on a replica (a bad one is refused there)."""
    checked_adapter_name(name)
    folder = str(adapter_folder(path, registry.model_roots, "path"))
    client = await registry.route(model_id)
    entry = registry.named(model_id)
    if isinstance(client, AdapterClient) or entry is None:
        raise InvalidRequestError(f"'{model_id}' is not a model: an adapter goes on a base model", param="model")
    listing = await client.load_adapter(name, folder)
    if listing.error is not None:
        raise listing.error
    registry.adapters.added(entry.model_id, name, folder)
    registry.store_adapters(entry)
    return AdapterRef(name, folder)


async def unload_adapter(registry: Registry, model_id: str, name: str) -> None:
    """New requests can no longer name it; requests running on it finish on it."""
    entry = registry.named(model_id)
    if entry is None:
        raise ModelNotFoundError(f"The model '{model_id}' is not loaded", param="model")
    await adapter_ref(registry, entry, name)  # a config model's own adapters known first
    registry.adapters.removed(entry, name)
    registry.store_adapters(entry)
    listing = await (await registry.route(entry.model_id)).unload_adapter(name)
    if listing.error is not None and not isinstance(listing.error, ModelNotFoundError):
        raise listing.error  # a replica that never loaded it has nothing to unload
