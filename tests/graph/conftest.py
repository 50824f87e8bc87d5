"""Fixtures for the graph tests (real Ray Serve): one Ray Serve cluster per session and the graph most graph modules
share. Every test here is marked `graph`."""

from __future__ import annotations

import os
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.serving import free_port, wait_until

GRAPH_DIR = Path(__file__).parent

# A graph of tiny models is running in ~20 s; with both cores of a 2-core machine busy elsewhere, several times
# that (each model replica starts its engine process). An upper bound that only a hung start reaches.
GRAPH_START_S = 300.0


def model_running(http, model_id: str, model_type: str | None = None) -> bool:
    """Whether the graph's loaded-models lists `model_id` as running (of `model_type`, if given)."""
    response = http.get("/v1/admin/loaded-models")
    return response.status_code == 200 and any(
        m["id"] == model_id and m["status"] == "running" and model_type in (None, m["type"])
        for m in response.json()["data"])


def deploy_graph(schema) -> None:
    """What `serve run serve_config.yaml` does, waiting up to GRAPH_START_S for every application to run (Serve's
    own blocking deploy gives up after 60 s); an application that fails to deploy fails at once, saying why."""
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ApplicationStatus

    for app in schema.applications:  # an ingress whose RAG deployment would keep documents in ~/.cache
        rag = app.args.get("rag", {}) if "model_path" not in app.args else None
        if rag is not None and not rag.get("storage_dir"):
            app.args["rag"] = {**rag, "storage_dir": tempfile.mkdtemp(prefix="orchard-rag-")}
    _get_global_client().deploy_apps(schema)
    names = {app.name for app in schema.applications}

    def all_running() -> bool:
        apps = serve.status().applications
        failed = {n: apps[n].message for n in names if n in apps and apps[n].status == ApplicationStatus.DEPLOY_FAILED}
        if failed:
            raise AssertionError(f"applications failed to deploy: {failed}")
        return all(n in apps and apps[n].status == ApplicationStatus.RUNNING for n in names)

    wait_until(all_running, GRAPH_START_S, interval_s=0.5, what=f"applications {sorted(names)} running")


@dataclass
class ServeCluster:
    port: int
    # The shared graph's Serve config once it is deployed (tests/graph/shared_graph.py): a module that restarts
    # Serve deploys it again.
    shared_schema: dict | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


RAY_START_ATTEMPTS = 2


def start_ray_serve() -> int:
    """Ray and Serve on 127.0.0.1; the HTTP port. A start that fails (on a busy machine Ray's processes can
    miss their start-up timeouts) is retried once, then reported as what it is, not as each test's failure."""
    import ray
    from ray import serve

    for attempt in range(1, RAY_START_ATTEMPTS + 1):
        try:
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
            port = free_port()
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            return port
        except Exception as exc:  # noqa: BLE001 - whatever Ray raises, the next step is the same
            ray.shutdown()
            if attempt == RAY_START_ATTEMPTS:
                raise RuntimeError(
                    f"Ray Serve did not start in {RAY_START_ATTEMPTS} attempts (last: {exc!r}); "
                    "is the machine overloaded, or is this not a loopback-only namespace (scripts/loopback.sh)?"
                ) from exc
            warnings.warn(f"Ray Serve did not start ({exc!r}); retrying once", stacklevel=1)
    raise AssertionError("unreachable")


# Read by Ray's raylet and Serve's controller, which inherit the test process's environment:
# - Ray starts its workers (Serve's proxy, the ingress, model replicas and so their engine processes) at nice 15:
#   beside any busy process of normal priority they got a sliver of the CPU, and the graph tests took 25 minutes;
# - Serve kills a proxy that is not ready within 5 s (then 10, 15, ...) or misses a 10 s health check, which a busy
#   2-core machine exceeded, failing serve.start;
# - Serve starts a replica whose constructor raised 3 times before it calls the deployment failed; the tests that
#   deploy one on purpose (a broken model, an ingress refusing to start) waited through 2 more failing starts.
#   No replica here fails its constructor by chance: nothing in one times out.
TEST_RAY_ENV = {
    "RAY_worker_niceness": "0",
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
    "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60",
    "RAY_SERVE_MAX_PER_REPLICA_RETRY_COUNT": "1",
}


@pytest.fixture(scope="session")
def serve_cluster():
    """One Ray instance and Serve (HTTP on 127.0.0.1) for the whole session: Ray starts in ~10 s."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    for name, value in TEST_RAY_ENV.items():
        os.environ.setdefault(name, value)
    import ray
    from ray import serve

    port = start_ray_serve()
    try:
        yield ServeCluster(port)
    finally:
        serve.shutdown()
        ray.shutdown()


RESTARTS_SERVE = "restarts_serve"


def pytest_configure(config):
    config.addinivalue_line("markers", f"{RESTARTS_SERVE}: restarts Ray Serve with only the applications it needs "
                                       "(not the whole shared graph); runs after every test of the shared graph")


@pytest.hookimpl(tryfirst=True)  # before `-m` selects: `-m "not graph"` leaves these out
def pytest_collection_modifyitems(config, items):
    """Every test here is marked `graph`; tests marked restarts_serve move to just after the last test that uses the
    shared graph, those among them that use it first."""
    for item in items:
        if GRAPH_DIR in item.path.parents:
            item.add_marker(pytest.mark.graph)
    restarting = [item for item in items if item.get_closest_marker(RESTARTS_SERVE)]
    rest = [item for item in items if not item.get_closest_marker(RESTARTS_SERVE)]
    users = [i for i, item in enumerate(rest) if _uses_shared_graph(item)]
    at = users[-1] + 1 if users else len(rest)
    # Those that still use the shared graph first: after the others no test needs it, so none deploys it again.
    restarting.sort(key=lambda item: not _uses_shared_graph(item))
    items[:] = rest[:at] + restarting + rest[at:]
    _SHARED_GRAPH_USERS_LEFT[0] = sum(_uses_shared_graph(item) for item in items)


def _uses_shared_graph(item) -> bool:
    return "shared_graph" in getattr(item, "fixturenames", ())


_SHARED_GRAPH_USERS_LEFT = [0]  # tests of this session still to run that use the shared graph


@pytest.fixture(autouse=True)
def _count_shared_graph_users(request):
    yield
    if "shared_graph" in request.fixturenames:
        _SHARED_GRAPH_USERS_LEFT[0] -= 1


def shared_graph_needed_again() -> bool:
    """Whether a test still to run uses the shared graph (a module that restarted Serve deploys it again only then)."""
    return _SHARED_GRAPH_USERS_LEFT[0] > 0


@pytest.fixture(scope="session")
def shared_graph(serve_cluster, tiny_models, tmp_path_factory):
    """The graph most graph modules share (tests/graph/shared_graph.py), started at its first use."""
    from tests.graph.shared_graph import SharedGraph, deploy_shared_graph, shared_graph_config

    root = tmp_path_factory.mktemp("shared-graph")
    schema = shared_graph_config(tiny_models, root)
    deploy_shared_graph(schema, serve_cluster.base_url)
    serve_cluster.shared_schema = schema
    return SharedGraph(serve_cluster, root / "state", schema)
