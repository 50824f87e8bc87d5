"""What an admin load may reserve, its deadline, its cancellation by an unload and the bound on loads at once
(issue 59): in process (no Ray); tests/graph/test_admin_loads_graph.py stalls real Serve loads."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from deployments.ingress_config import AdminLoadLimits
from tests.serve.local_stack import local_stack, slow_engine_client, wait_for

CHAT = {"messages": [{"role": "user", "content": "t1"}], "max_tokens": 3, "temperature": 0}


def _stored_ids(state_dir) -> list[str]:
    stored = state_dir / "models.json"
    return [m["model_id"] for m in json.loads(stored.read_text())["models"]] if stored.exists() else []


async def _listed(stack) -> dict[str, str]:
    return {m["id"]: m["status"] for m in (await stack.http.get("/v1/admin/loaded-models")).json()["data"]}


@pytest.mark.parametrize("fields, param", [
    ({"ray_actor_options": {"num_cpus": 1000}}, "ray_actor_options.num_cpus"),
    ({"ray_actor_options": {"num_gpus": 1}}, "ray_actor_options.num_gpus"),  # no GPU here
    ({"ray_actor_options": {"memory": 10**18}}, "ray_actor_options.memory"),
    ({"ray_actor_options": {"resources": {"TPU": 1}}}, "ray_actor_options.resources"),
    ({"num_replicas": 100}, "num_replicas"),
    ({"autoscaling": {"max_replicas": 100}}, "autoscaling.max_replicas"),
])
def test_resources_no_node_could_hold_or_over_the_operators_limits_are_refused_at_once(
        tiny_models, tmp_path, fields, param):
    async def scenario():
        async with local_stack([], tmp_path, model_roots=[str(tiny_models.gamma.parent)]) as stack:
            started = time.monotonic()
            answer = await stack.http.post("/v1/admin/load-model", json={
                "model_id": "greedy", "model_path": str(tiny_models.gamma), **fields})
            assert answer.status_code == 400, answer.text
            assert answer.json()["error"]["param"] == param
            assert time.monotonic() - started < 2  # refused, not attempted
            assert await _listed(stack) == {} and _stored_ids(tmp_path) == []

    asyncio.run(scenario())


def test_operator_maxima_bound_loads_over_http(tiny_models, tmp_path):
    limits = AdminLoadLimits(max_cpus_per_replica=0.5, max_replicas=2)

    async def scenario():
        async with local_stack([], tmp_path, model_roots=[str(tiny_models.gamma.parent)], load_limits=limits) as stack:
            body = {"model_id": "g", "model_path": str(tiny_models.gamma)}
            over = await stack.http.post("/v1/admin/load-model", json={**body, "ray_actor_options": {"num_cpus": 1}})
            assert over.status_code == 400 and "admin_loads.max_cpus_per_replica" in over.json()["error"]["message"]
            within = await stack.http.post("/v1/admin/load-model", json={
                **body, "num_replicas": 2, "ray_actor_options": {"num_cpus": 0.5}})
            assert within.status_code == 200, within.text

    asyncio.run(scenario())


def test_a_load_past_its_deadline_fails_says_why_and_is_not_kept(tiny_models, tmp_path):
    limits = AdminLoadLimits(timeout_s=0.5)

    async def scenario():
        async with local_stack([], tmp_path, new_engine_client=slow_engine_client(30), load_limits=limits,
                               model_roots=[str(tiny_models.gamma.parent)]) as stack:
            started = time.monotonic()
            answer = await stack.http.post("/v1/admin/load-model", json={"model_path": str(tiny_models.gamma)})
            assert answer.status_code == 503 and answer.json()["error"]["code"] == "model_load_failed"
            assert "admin_loads.timeout_s" in answer.json()["error"]["message"]
            assert time.monotonic() - started < 10
            assert await _listed(stack) == {"gamma": "failed"}
            assert stack.backend._services == {} and _stored_ids(tmp_path) == []  # stopped, and not kept

    asyncio.run(scenario())


def test_an_unload_cancels_a_load_in_flight_and_the_load_answers_so(tiny_models, tmp_path):
    async def scenario():
        async with local_stack([], tmp_path, new_engine_client=slow_engine_client(60),
                               model_roots=[str(tiny_models.gamma.parent)]) as stack:
            http = stack.http
            waiting = asyncio.ensure_future(http.post("/v1/admin/load-model", json={"model_path": str(tiny_models.gamma)}))
            await wait_for(lambda: _is_loading(stack))
            started = time.monotonic()
            unloaded = await http.delete("/v1/admin/unload-model/gamma")
            assert unloaded.status_code == 200 and unloaded.json() == {"status": "unloaded", "model_id": "gamma"}
            assert time.monotonic() - started < 5  # not after the 60 s start
            load = await waiting
            assert load.status_code == 503 and "cancelled" in load.json()["error"]["message"]
            assert await _listed(stack) == {} and stack.backend._services == {} and _stored_ids(tmp_path) == []

    asyncio.run(scenario())


async def _is_loading(stack) -> bool:
    return (await _listed(stack)).get("gamma") == "loading"


def test_loads_at_once_are_bounded_and_the_status_routes_stay_quick(tiny_models, tmp_path):
    limits = AdminLoadLimits(max_in_flight=2)

    async def scenario():
        async with local_stack([], tmp_path, new_engine_client=slow_engine_client(60), load_limits=limits,
                               model_roots=[str(tiny_models.gamma.parent)]) as stack:
            http = stack.http
            for name in ("s1", "s2"):
                accepted = await http.post("/v1/admin/load-model?wait=false",
                                           json={"model_id": name, "model_path": str(tiny_models.gamma)})
                assert accepted.status_code == 202
            refused = await http.post("/v1/admin/load-model?wait=false",
                                      json={"model_id": "s3", "model_path": str(tiny_models.gamma)})
            assert refused.status_code == 429 and refused.json()["error"]["code"] == "too_many_loads"
            assert refused.headers["retry-after"] == "5" and "s1, s2" in refused.json()["error"]["message"]
            for route in ("/health", "/metrics", "/v1/models", "/v1/queue/stats", "/v1/admin/loaded-models"):
                started = time.monotonic()
                assert (await http.get(route)).status_code in (200, 503)
                assert time.monotonic() - started < 1, route
            assert (await http.delete("/v1/admin/unload-model/s1")).status_code == 200
            again = await http.post("/v1/admin/load-model?wait=false",
                                    json={"model_id": "s3", "model_path": str(tiny_models.gamma)})
            assert again.status_code == 202  # the slot was freed by the unload
            assert _stored_ids(tmp_path) == []

    asyncio.run(scenario())
