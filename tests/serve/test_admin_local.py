"""Admin load/unload, loading and failed states, persistence across restarts, /health and /ready: in-process
(no Ray)."""

from __future__ import annotations

import asyncio
import json

from deployments.config import ModelConfig
from tests.serve.local_stack import local_stack, slow_engine_client, wait_for

CHAT = {"messages": [{"role": "user", "content": "t1"}], "max_tokens": 3, "temperature": 0}


async def _status(stack, model_id: str) -> str | None:
    data = (await stack.http.get("/v1/admin/loaded-models")).json()["data"]
    return next((m["status"] for m in data if m["id"] == model_id), None)


def _stored_ids(state_dir) -> list[str]:
    return [m["model_id"] for m in json.loads((state_dir / "models.json").read_text())["models"]]


def _roots(tiny_models) -> list[str]:
    """Admin loads take folders under model_roots only: the tiny models' folder."""
    return [str(tiny_models.alpha.parent)]


def test_load_answers_503_while_loading_then_serves_then_unloads(tiny_models, tmp_path):
    async def scenario():
        async with local_stack(
            [], tmp_path, new_engine_client=slow_engine_client(0.5), model_roots=_roots(tiny_models)
        ) as stack:
            http = stack.http
            accepted = await http.post("/v1/admin/load-model", json={"model_path": str(tiny_models.gamma)})
            assert accepted.status_code == 202
            assert accepted.json() == {
                "status": "loading", "model_id": "gamma", "model_path": str(tiny_models.gamma), "model_type": "lm"
            }
            loading = await http.post("/v1/chat/completions", json={"model": "gamma", **CHAT})
            assert loading.status_code == 503 and loading.headers["retry-after"] == "5"
            assert loading.json()["error"]["code"] == "model_loading"
            listed = (await http.get("/v1/models")).json()["data"]
            assert [(m["id"], m["status"]) for m in listed] == [("gamma", "loading")]
            assert _stored_ids(tmp_path) == ["gamma"]
            not_ready = await http.get("/ready")
            assert not_ready.status_code == 503
            assert not_ready.json() == {"ready": False, "running": [], "loading": ["gamma"], "failed": []}
            assert (await http.get("/health")).json()["ready"] is False

            await wait_for(lambda: _is(stack, "gamma", "running"))
            ready = await http.get("/ready")
            assert ready.status_code == 200
            assert ready.json() == {"ready": True, "running": ["gamma"], "loading": [], "failed": []}
            assert (await http.get("/health")).json()["ready"] is True
            answer = await http.post("/v1/chat/completions", json={"model": "gamma", **CHAT})
            assert answer.status_code == 200 and answer.json()["model"] == "gamma"

            assert (await http.delete("/v1/admin/unload-model/gamma")).json() == {"status": "unloading", "model_id": "gamma"}
            await wait_for(lambda: _gone(stack, "gamma"))
            gone = await http.post("/v1/chat/completions", json={"model": "gamma", **CHAT})
            assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
            assert _stored_ids(tmp_path) == []

    asyncio.run(scenario())


async def _is(stack, model_id: str, status: str) -> bool:
    return await _status(stack, model_id) == status


async def _gone(stack, model_id: str) -> bool:
    return await _status(stack, model_id) is None


def test_api_loaded_models_come_back_after_a_restart(tiny_models, tmp_path):
    async def first_life():
        async with local_stack([], tmp_path, model_roots=_roots(tiny_models)) as stack:
            body = {"model_id": "org/gamma", "model_path": str(tiny_models.gamma), "cb_max_num_seqs": 7}
            assert (await stack.http.post("/v1/admin/load-model", json=body)).status_code == 202
            await wait_for(lambda: _is(stack, "org/gamma", "running"))

    async def second_life(restore: bool):
        async with local_stack([], tmp_path, restore=restore, model_roots=_roots(tiny_models)) as stack:
            if not restore:
                return await _status(stack, "org/gamma")
            await wait_for(lambda: _is(stack, "org/gamma", "running"))
            answer = await stack.http.post("/v1/chat/completions", json={"model": "org/gamma", **CHAT})
            stats = (await stack.http.get("/v1/queue/stats")).json()["models"][0]
            return answer.status_code, stats["max_num_seqs"]

    asyncio.run(first_life())
    assert asyncio.run(second_life(restore=False)) is None
    assert asyncio.run(second_life(restore=True)) == (200, 7)  # restored with its own options


def test_failed_load_reports_why_and_the_rest_keep_serving(tiny_models, tmp_path):
    alpha = ModelConfig(model_id="alpha", model_path=str(tiny_models.alpha))

    async def scenario():
        async with local_stack([alpha], tmp_path, model_roots=_roots(tiny_models)) as stack:
            http = stack.http
            accepted = await http.post("/v1/admin/load-model", json={"model_id": "broken", "model_path": str(tiny_models.broken)})
            assert accepted.status_code == 202
            await wait_for(lambda: _is(stack, "broken", "failed"))
            detail = next(m for m in (await http.get("/v1/admin/loaded-models")).json()["data"] if m["id"] == "broken")
            assert "no_such_architecture" in detail["error"] and detail["pid"] is None
            # Bodega's docs read model.get("memory", {}).get("total_mb", 0): an object even with no figures.
            assert detail["memory"] == {} and detail["memory"].get("total_mb", 0) == 0
            refused = await http.post("/v1/chat/completions", json={"model": "broken", **CHAT})
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "model_load_failed"
            assert (await http.post("/v1/chat/completions", json={"model": "alpha", **CHAT})).status_code == 200
            health = (await http.get("/health")).json()
            assert health["status"] == "ok" and {d["id"]: d["status"] for d in health["models_detail"]} == {
                "alpha": "running", "broken": "failed"
            }
            # Up, but not every model runs: a client waiting for the server can tell, and stop waiting on a failure.
            not_ready = await http.get("/ready")
            assert health["ready"] is False and not_ready.status_code == 503
            assert not_ready.json() == {"ready": False, "running": ["alpha"], "loading": [], "failed": ["broken"]}
            assert (await http.delete("/v1/admin/unload-model/broken")).status_code == 200
            await wait_for(lambda: _gone(stack, "broken"))

    asyncio.run(scenario())


def test_admin_conflicts_roots_and_unknown_models(tiny_models, tmp_path):
    alpha = ModelConfig(model_id="alpha", model_path=str(tiny_models.alpha))

    async def scenario():
        async with local_stack([alpha], tmp_path, model_roots=[str(tiny_models.alpha)]) as stack:
            http = stack.http
            again = await http.post("/v1/admin/load-model", json={"model_id": "alpha", "model_path": str(tiny_models.alpha)})
            assert again.status_code == 409 and again.json()["error"]["code"] == "model_already_loaded"
            outside = await http.post("/v1/admin/load-model", json={"model_path": str(tiny_models.gamma)})
            assert outside.status_code == 400 and "model_roots" in outside.json()["error"]["message"]
            unknown_type = await http.post("/v1/admin/load-model", json={"model_path": str(tiny_models.alpha), "model_type": "diffusion"})
            assert unknown_type.status_code == 400 and unknown_type.json()["error"]["param"] == "model_type"
            missing = await http.delete("/v1/admin/unload-model/nobody")
            assert missing.status_code == 404 and missing.json()["error"]["param"] == "model_id"

    asyncio.run(scenario())


def test_health_without_models_is_unhealthy(tmp_path):
    async def scenario():
        async with local_stack([], tmp_path) as stack:
            return await stack.http.get("/health"), await stack.http.get("/ready")

    health, ready = asyncio.run(scenario())
    assert health.status_code == 503
    assert health.json() == {"status": "unhealthy", "ready": False, "model_id": None, "model_status": "no_models"}
    assert ready.status_code == 503
    assert ready.json() == {"ready": False, "running": [], "loading": [], "failed": []}
