"""Issue 55's scenario through real Ray Serve: an ingress with a memory budget for two tiny models and three
on_demand ones. Requests rotating over the three all succeed (each model loaded by its first request, the least
recently used one evicted to make room), and the resident bytes loaded-models reports, sampled every 100 ms, never
pass the budget. Serve is given an ingress of its own for this module (restarts_serve), the shared graph after."""

from __future__ import annotations

import threading

import httpx
import pytest

from deployments.config import ModelConfig
from deployments.ingress.footprint import model_footprint
from tests.graph.conftest import GRAPH_START_S, deploy_graph, shared_graph_needed_again
from tests.graph.shared_graph import deploy_shared_graph
from tests.support.serving import wait_until

pytestmark = pytest.mark.restarts_serve
MODELS = ("alpha", "beta", "gamma")


@pytest.fixture(scope="module")
def budget_graph(serve_cluster, tiny_models, tmp_path_factory):
    from ray.serve.schema import ServeDeploySchema

    folders = {name: getattr(tiny_models, name) for name in MODELS}
    budget = 2 * max(model_footprint(ModelConfig(model_path=str(f))).total_bytes for f in folders.values()) + 1024
    on_demand = [{"model_id": name, "model_path": str(folder)} for name, folder in folders.items()]
    ingress = {"name": "orchard", "route_prefix": "/", "import_path": "deployments.app:build_app",
               "args": {"state_dir": str(tmp_path_factory.mktemp("budget-state")), "status_poll_interval_s": 0.5,
                        "rag": None, "memory": {"budget_bytes": budget}, "on_demand": on_demand}}
    deploy_graph(ServeDeploySchema.model_validate({"applications": [ingress]}))
    try:
        yield serve_cluster, budget
    finally:
        if serve_cluster.shared_schema is not None and shared_graph_needed_again():
            deploy_shared_graph(serve_cluster.shared_schema, serve_cluster.base_url)


def test_requests_rotating_over_three_on_demand_models_fit_a_budget_for_two(budget_graph):
    cluster, budget = budget_graph
    samples: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        with httpx.Client(base_url=cluster.base_url, timeout=30) as http:
            while not stop.is_set():
                listing = http.get("/v1/admin/loaded-models")
                if listing.status_code == 200:
                    samples.append(listing.json()["memory_budget"]["resident_bytes"])
                stop.wait(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    with httpx.Client(base_url=cluster.base_url, timeout=GRAPH_START_S) as http:
        wait_until(lambda: http.get("/v1/models").status_code == 200, GRAPH_START_S, what="the ingress")
        assert {m["id"]: m["status"] for m in http.get("/v1/models").json()["data"]} == dict.fromkeys(MODELS, "unloaded")
        sampler.start()
        try:
            for turn, name in enumerate(["alpha", "beta", "gamma", "alpha"]):
                body = {"model": name, "messages": [{"role": "user", "content": "t1 t2"}], "max_tokens": 2,
                        "stream": turn == 2}
                answer = http.post("/v1/chat/completions", json=body)
                assert answer.status_code == 200 and '"error"' not in answer.text, answer.text
        finally:
            stop.set()
            sampler.join()
        described = http.get("/v1/admin/loaded-models").json()["memory_budget"]
        events = [(e["event"], e["model_id"]) for e in described["events"]]
    # Each model's memory read once it served (its replica's process): its weights at least, within its estimate.
    measured = {m["id"]: (m["measured_bytes"], m["footprint_bytes"]) for m in described["models"]}
    assert set(measured) == {"gamma", "alpha"}
    assert all(0 < held <= counted for held, counted in measured.values()), measured
    assert events == [("load", "alpha"), ("load", "beta"), ("load", "gamma"), ("evict", "alpha"),
                      ("load", "alpha"), ("evict", "beta")]
    assert len(samples) > 10 and max(samples) <= budget
