"""Registry: model id -> status, client and details; admin load/unload; the persisted model list.

The backend (Ray Serve, or in-process for tests) is the source of truth for which models exist;
the registry adds what only it knows: loads and unloads in flight, failures, API-loaded configs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from deployments.hub.downloads import DownloadManager
from engine.errors import (
    EngineRestartingError,
    InvalidRequestError,
    ModelExistsError,
    ModelLoadError,
    ModelLoadingError,
    ModelNotFoundError,
    NoModelsLoadedError,
    OrchardError,
    TooManyLoadsError,
)
from deployments.config import ModelConfig
from deployments.ingress_config import AdminLoadLimits
from deployments.model_sources import (
    HubFetch, check_admin_model, check_admin_policy, check_operator_model, default_model_roots,
)
from deployments.model_calls import MetricsSnapshot, ModelClient, ModelInfo
from deployments.ingress.adapter_catalog import AdapterCatalog, route_adapter, split_adapter_id
from deployments.ingress.auto_load import AutoLoadingClient
from deployments.ingress.budgeted_loads import BudgetedLoads
from deployments.ingress.cached_repos import cached_repo_config, repo_allowed
from deployments.ingress.load_limits import check_load_resources
from deployments.ingress.load_steps import (
    check_admin_load, check_not_reserved, deploy_within_deadline, download_for_load, pending_downloads,
)
from deployments.ingress.model_entries import (
    AdminOperation, DeploymentState, ModelBackend, ModelEntry, ModelQueueStats, ModelStatus,
)
from deployments.ingress.model_readings import ModelReadings
from deployments.ingress.model_store import ModelStore
from deployments.ingress.node_memory import LoadPlan, NodeMemory
from deployments.ingress.replica_watch import ReplicaWatch
from deployments.ingress.status_refresh import StatusRefresher

logger = logging.getLogger("ray.serve.orchard")


class Registry:
    def __init__(
        self,
        backend: ModelBackend,
        store: ModelStore | None = None,
        model_roots: list[str] | None = None,
        poll_interval_s: float = 2.0,
        downloads: DownloadManager | None = None,
        load_limits: AdminLoadLimits | None = None,
        memory_budget_bytes: int | None = None,
        on_demand: list[ModelConfig] | None = None,
        auto_load_repos: list[str] | None = None,
    ) -> None:
        self._backend = backend
        # The node's memory budget across models (node_memory.py); None: none, every load is tried.
        self.memory = NodeMemory(memory_budget_bytes) if memory_budget_bytes else None
        # Models loaded by the first request that names them (auto_load.py), again after an eviction.
        self._on_demand = {config.id: config for config in on_demand or []}
        self._auto_load_repos = auto_load_repos or []  # cached repos a request may load so (cached_repos.py)
        self._load_limits = load_limits or AdminLoadLimits()
        # Hugging Face downloads of this server (admin downloads, and loads with auto_download).
        self.downloads = downloads
        self._store = store
        # Admin loads of local folders must lie under these (None: Orchard's and Hugging Face's model caches).
        self._model_roots = default_model_roots() if model_roots is None else list(model_roots)
        self._poll_interval_s = poll_interval_s
        self._entries: dict[str, ModelEntry] = {}
        self._api_configs: dict[str, ModelConfig] = {}
        self._served_once: set[str] = set()  # API-loaded ids whose model has served: only these are persisted
        self._tasks: set[asyncio.Task] = set()
        self._closed = False
        self._status = StatusRefresher(self._refresh_now)
        self._replicas = ReplicaWatch(backend, self.fetch_info, self._spawn)
        self._readings = ModelReadings(backend, self._replicas.lost)
        self._budget = BudgetedLoads(self.memory, self._readings, self._load_limits.timeout_s) if self.memory else None
        self.adapters = AdapterCatalog()  # per-request LoRA adapters: 'MODEL:NAME' (adapter_catalog.py)

    # ---- lifecycle --------------------------------------------------------------
    async def start(self, restore: bool = True) -> None:
        await self.refresh(force=True)
        if restore and self._store is not None:
            await self._restore(self._store.load())
        for config in self._on_demand.values():
            if config.pinned and config.id not in self._entries:  # pinned: resident from the start
                with contextlib.suppress(OrchardError):
                    self._auto_load(config)
        self._spawn(self._poll())

    async def _restore(self, stored: list[ModelConfig]) -> None:
        """Reload the API-loaded models of the last run that an admin load would accept now.

        A refused one is never applied and is left out of the list from its next save; one whose folder or
        cached repo is merely missing is kept and shows as failed (check_admin_model runs again in _deploy).
        """
        reserved, capacity = await self._backend.reserved_names(), await self._backend.capacity()
        for config in stored:
            try:
                check_admin_policy(config, self._model_roots)
                check_load_resources(config, self._load_limits, capacity)
                check_not_reserved(config.id, reserved)
            except InvalidRequestError as exc:
                logger.warning("not restoring stored model '%s': %s", config.id, exc.message)
                continue
            self._api_configs[config.id] = config
            self._served_once.add(config.id)  # it was stored: it served in an earlier run
            running = self._entries.get(config.id)
            if running is not None:  # the ingress restarted, the model's application did not: it is still ours
                running.source, running.config = "api", config
                continue
            logger.info("restoring model %s loaded through the API before a restart", config.id)
            self._begin_load(config)

    async def close(self) -> None:
        self._closed = True  # the poll loop ends even where a cancellation of it is lost
        await self._status.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # their ends, cancelled or failed

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _poll(self) -> None:
        while not self._closed:
            await asyncio.sleep(self._poll_interval_s)
            try:
                await self.refresh()
            except Exception:  # a controller hiccup must not end polling
                logger.exception("model status refresh failed")
            for entry in self.entries():
                self._replicas.lost(entry)  # a dead replica shows without anyone asking
            for model_id in self.memory.idle_models(self._api_configs) if self.memory is not None else ():
                logger.info("unloading model %s: no request for its idle_unload_s", model_id)
                self._spawn(self._unload_quietly(model_id))

    # ---- status -------------------------------------------------------------------
    async def refresh(self, force: bool = False) -> None:
        """Serve's view of the models, waited for at most a bound (status_refresh.py)."""
        await self._status.refresh(force)

    async def _refresh_now(self) -> None:
        self._merge(await self._backend.deployments())

    def _merge(self, states: dict[str, DeploymentState]) -> None:
        for model_id, state in states.items():
            entry = self._entries.get(model_id)
            if entry is None:
                source = "api" if model_id in self._api_configs else "config"
                entry = self._entries[model_id] = ModelEntry(
                    model_id, state.status, source, self._api_configs.get(model_id), seen_at=int(time.time())
                )
            if entry.busy:
                continue
            entry.status, entry.error = state.status, entry.as_sent(state.message)
        for model_id, entry in list(self._entries.items()):
            if model_id in states or entry.busy:
                continue
            if entry.source == "api" and entry.status != ModelStatus.FAILED:
                entry.status, entry.error = ModelStatus.FAILED, "The model's application disappeared; load it again"
            elif entry.source != "api":
                del self._entries[model_id]
                self._release(model_id)

    def entries(self) -> list[ModelEntry]:
        return sorted(self._entries.values(), key=lambda e: e.model_id)

    def named(self, name: str) -> ModelEntry | None:
        """The model of that id; else the one model loaded from that model_path (Bodega's id "defaults to path":
        a model loaded without model_id answers to its repo id or folder too, and to Orchard's shorter id)."""
        entry = self._entries.get(name)
        if entry is not None:
            return entry
        by_path = [e for e in self._entries.values() if e.config is not None and e.config.model_path == name]
        return by_path[0] if len(by_path) == 1 else None

    async def route(self, model_id: str) -> ModelClient:
        """The client of a serving model, or the typed error that says why there is none."""
        entry = self.named(model_id)
        if entry is None or entry.status != ModelStatus.RUNNING:
            await self.refresh()
            entry = self.named(model_id)
        if entry is None and (split := split_adapter_id(model_id)) is not None and self.named(split[0]) is not None:
            return await route_adapter(self, *split)
        if entry is None and model_id not in self._on_demand and repo_allowed(model_id, self._auto_load_repos):
            config = await asyncio.to_thread(cached_repo_config, model_id, self._auto_load_repos)  # reads the cache
            if config is not None and self.named(model_id) is None:
                self._on_demand[model_id] = config  # on_demand from now on: listed unloaded once evicted
        if entry is None and model_id in self._on_demand:
            entry = self._auto_load(self._on_demand[model_id])
        if entry is None and not self._entries:
            raise NoModelsLoadedError(
                f"No model is loaded: load '{model_id}' first (POST /v1/admin/load-model)", param="model")
        if entry is None:
            raise ModelNotFoundError(f"The model '{model_id}' does not exist", param="model")
        model_id = entry.model_id
        if entry.on_demand and entry.status in (ModelStatus.LOADING, ModelStatus.UNLOADING):
            return AutoLoadingClient(entry, self.route)  # waits for the load (or unload, then loads again)
        if entry.status == ModelStatus.UNLOADING:
            raise ModelNotFoundError(f"The model '{model_id}' is being unloaded", param="model")
        if entry.status == ModelStatus.LOADING:
            why = f" ({entry.error})" if entry.error else ""
            raise ModelLoadingError(f"The model '{model_id}' is loading{why}; retry shortly")
        if entry.status == ModelStatus.FAILED:
            raise ModelLoadError(f"The model '{model_id}' failed to load: {entry.error}", param="model")
        if entry.status == ModelStatus.UNHEALTHY:  # Serve replaces an unhealthy replica: worth a retry
            raise EngineRestartingError(f"The model '{model_id}' is unhealthy and restarting: {entry.error}")
        if self._replicas.lost(entry):  # else Serve would hold the call until its replacement serves
            raise EngineRestartingError(f"The model '{model_id}' is restarting: {entry.current_error}")
        client = await self._backend.client(model_id)
        return self.memory.counted(client, model_id) if self.memory is not None else client

    @property
    def model_roots(self) -> list[str]:
        return self._model_roots

    async def fetch_info(self, model_id: str) -> ModelInfo | None:
        return await self._readings.info(model_id)

    def store_adapters(self, entry: ModelEntry) -> None:
        """An API-loaded model's adapters are kept with its config, so a restart restores them."""
        config = self._api_configs.get(entry.model_id)
        if config is None:
            return
        self._api_configs[entry.model_id] = entry.config = config.model_copy(update={"adapters": self.adapters.of(entry)})
        self._persist()

    async def details(self) -> list[ModelEntry]:
        """Entries with fresh info (memory, pid) from each running model."""
        await self.refresh()
        running = self._answering()
        infos = await asyncio.gather(*(self._replicas.unless_lost(e, self._readings.info(e.model_id)) for e in running))
        for entry, info in zip(running, infos):
            entry.info = info or entry.info
        return self.entries()

    def _answering(self) -> list[ModelEntry]:
        """The running models whose replica can answer now (a dead one's calls would wait for its replacement)."""
        return [e for e in self.entries() if e.status == ModelStatus.RUNNING and not self._replicas.lost(e)]

    async def queue_stats(self) -> list[ModelQueueStats]:
        await self.refresh()
        entries = self.entries()
        stats = await asyncio.gather(*(self._replicas.unless_lost(e, self._readings.stats(e)) for e in entries))
        return [ModelQueueStats(e, s) for e, s in zip(entries, stats)]

    async def metrics(self) -> list[MetricsSnapshot]:
        """Every running model's metrics (a model that does not answer in time is left out of this scrape)."""
        await self.refresh()
        running = self._answering()
        snapshots = await asyncio.gather(*(self._replicas.unless_lost(e, self._readings.metrics(e.model_id))
                                           for e in running))
        return [s for s in snapshots if s is not None]

    # ---- admin ----------------------------------------------------------------------
    async def load(self, config: ModelConfig) -> ModelEntry:
        """Accept a load: validated now, deployed in the background (status loading -> running/failed).

        The config is kept as sent (a repo id, not its snapshot folder), so a restore resolves it again; it is
        persisted once the model serves (a load that never does must not come back at every start).
        """
        self._check_admin(config)
        check_load_resources(config, self._load_limits, await self._backend.capacity())
        await self.refresh(force=True)
        check_not_reserved(config.id, await self._backend.reserved_names())
        existing = self._entries.get(config.id)
        if config.id in self._on_demand:
            raise ModelExistsError(f"The model '{config.id}' is configured on_demand: a request naming it loads it",
                                   param="model_id")
        if existing is not None and existing.source != "api":
            raise ModelExistsError(f"The model '{config.id}' is configured in serve_config.yaml", param="model_id")
        if existing is not None and existing.status != ModelStatus.FAILED:
            raise ModelExistsError(f"The model '{config.id}' is already {existing.status.value}", param="model_id")
        self._check_loads_in_flight()
        if self._budget is not None:
            await self._budget.count_configured(self.entries())
        plan = self._plan_now(config)
        self._api_configs[config.id] = config
        self._served_once.discard(config.id)  # a failed one loaded again: stored once this load serves
        self._persist()
        return self._begin_load(config, plan)

    def on_demand_unloaded(self) -> list[ModelConfig]:
        """The on_demand models not loaded now (a request naming one loads it)."""
        return [config for model_id, config in sorted(self._on_demand.items()) if model_id not in self._entries]

    def _auto_load(self, config: ModelConfig) -> ModelEntry:
        """An on_demand model a request named: loaded now (room made under the memory budget, else 507)."""
        self._check_loads_in_flight()
        if self._budget is not None and not self._pending_downloads(config):
            self._budget.refuse_unless_it_could_fit(config, self._resolved(config, True))
        logger.info("loading model %s: a request names it (on_demand)", config.id)
        return self._begin_load(config, None, on_demand=True)  # room is made (or waited for) as it starts

    def _begin_load(self, config: ModelConfig, plan: LoadPlan | None = None, on_demand: bool = False) -> ModelEntry:
        source = "config" if on_demand else "api"  # an on_demand model is the operator's, as serve_config.yaml's
        entry = ModelEntry(config.id, ModelStatus.LOADING, source, config, busy=True, seen_at=int(time.time()),
                           on_demand=on_demand)
        self._entries[config.id] = entry
        entry.load_task = self._spawn(self._deploy(entry, config, plan))
        return entry

    def _plan_now(self, config: ModelConfig, on_demand: bool = False) -> LoadPlan | None:
        """Room under the memory budget, decided (or refused, 507) at once where the files are here; a download's
        is decided once it is."""
        if self.memory is None or self._pending_downloads(config):
            return None
        return self.memory.plan(config, self._resolved(config, on_demand))

    def _resolved(self, config: ModelConfig, on_demand: bool) -> ModelConfig:
        """The config with its local files: an admin load's within model_roots, an operator's as it is."""
        return check_operator_model(config) if on_demand else check_admin_model(config, self._model_roots)

    async def _unload_quietly(self, model_id: str) -> None:
        with contextlib.suppress(OrchardError):
            await self.unload(model_id)

    def _check_loads_in_flight(self) -> None:
        limit = self._load_limits.max_in_flight
        loading = [e.model_id for e in self._entries.values() if e.load_task is not None and not e.load_task.done()]
        if len(loading) >= limit:
            raise TooManyLoadsError(
                f"{len(loading)} loads are running ({', '.join(sorted(loading))}), as many as this server allows at "
                f"once (admin_loads.max_in_flight {limit}); retry when one settles, or unload one to cancel it")

    def _check_admin(self, config: ModelConfig) -> None:
        check_admin_load(config, self._model_roots, bool(self._pending_downloads(config)))

    def _pending_downloads(self, config: ModelConfig) -> list[HubFetch]:
        return pending_downloads(config, self.downloads)

    async def _deploy(self, entry: ModelEntry, config: ModelConfig, plan: LoadPlan | None) -> None:
        started, failure = time.monotonic(), None
        try:
            for fetch in self._pending_downloads(config):
                await download_for_load(self.downloads, fetch)
            resolved = self._resolved(config, entry.on_demand)
            if resolved.model_path != config.model_path:
                entry.loaded_from = resolved.model_path
            if self._budget is not None:
                resolved = await self._budget.make_room(entry, config, resolved, plan, self.entries(), self.unload)
            await deploy_within_deadline(self._backend, resolved, self._load_limits.timeout_s)
        except asyncio.CancelledError:  # an unload (which deletes what was started), or the ingress closing
            self._release(config.id)
            failure = ModelLoadError(f"The load of '{config.id}' was cancelled: the model was unloaded",
                                     param="model_id")
            raise
        except Exception as exc:
            message = entry.as_sent(exc.message if isinstance(exc, OrchardError) else repr(exc))
            failure = exc if isinstance(exc, OrchardError) else ModelLoadError(message, param="model_path")
            failure.message = message
            entry.status, entry.error = ModelStatus.FAILED, message
            self._release(config.id)
            logger.error("model %s failed to load: %s", config.id, message)
        else:
            entry.status, entry.error = ModelStatus.RUNNING, None
            if self._budget is not None:
                self.memory.loaded(config.id)
                self._spawn(self._budget.measure(config.id))
            if config.id not in self._served_once:  # a restored one is stored already: a start writes nothing
                self._served_once.add(config.id)
                self._persist()
            logger.info("model %s loaded in %.1f s", config.id, time.monotonic() - started)
        finally:
            entry.busy = False
            entry.operation.finish(failure)

    async def unload(self, model_id: str) -> ModelEntry:
        """Begin an unload and return at once: new requests are refused now, open streams get the model's drain
        time and then end with model_unloaded, and the memory is freed in the background (status unloading)."""
        await self.refresh(force=True)
        entry = self.named(model_id)
        if entry is None:
            raise ModelNotFoundError(f"The model '{model_id}' is not loaded", param="model_id")
        model_id = entry.model_id
        if entry.load_task is not None and not entry.load_task.done():
            await self._cancel_load(entry)  # then unloaded as any other: what it started is deleted
        elif entry.busy:
            raise ModelExistsError(f"The model '{model_id}' is {entry.status.value}; retry when it settles")
        entry.status, entry.busy = ModelStatus.UNLOADING, True
        entry.operation = AdminOperation()  # now the unload's
        self._served_once.discard(model_id)
        self.adapters.forget(model_id)
        if self._api_configs.pop(model_id, None) is not None:
            self._persist()  # now: a restart during the drain must not bring the model back
        self._spawn(self._undeploy(entry))
        return entry

    @staticmethod
    async def _cancel_load(entry: ModelEntry) -> None:
        assert entry.load_task is not None
        logger.info("cancelling the load of model %s: it is being unloaded", entry.model_id)
        entry.load_task.cancel()
        await asyncio.wait([entry.load_task])

    async def _undeploy(self, entry: ModelEntry) -> None:
        started, failure = time.monotonic(), None
        try:
            await self._backend.undeploy(entry.model_id)
        except Exception as exc:
            entry.status, entry.error = ModelStatus.FAILED, f"The unload failed: {exc!r}"
            self._release(entry.model_id)
            failure = exc
            logger.exception("model %s did not unload", entry.model_id)
            return
        finally:
            entry.busy = False
            entry.operation.finish(failure)
        if self._entries.get(entry.model_id) is entry:
            del self._entries[entry.model_id]
        self._release(entry.model_id)
        logger.info("model %s unloaded in %.1f s", entry.model_id, time.monotonic() - started)

    def _release(self, model_id: str) -> None:
        if self.memory is not None:
            self.memory.released(model_id)

    def _persist(self) -> None:
        if self._store is not None:
            self._store.save([c for c in self._api_configs.values() if c.id in self._served_once])
