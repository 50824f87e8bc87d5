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
    stored = state_dir / "models.json"
    return [m["model_id"] for m in json.loads(stored.read_text())["models"]] if stored.exists() else []


def _roots(tiny_models) -> list[str]:
    """Admin loads take folders under model_roots only: the tiny models' folder."""
    return [str(tiny_models.alpha.parent)]


def test_load_answers_503_while_loading_then_serves_then_unloads(tiny_models, tmp_path):
    async def scenario():
        async with local_stack(
            [], tmp_path, new_engine_client=slow_engine_client(0.5), model_roots=_roots(tiny_models)
        ) as stack:
            http = stack.http
            accepted = await http.post("/v1/admin/load-model?wait=false", json={"model_path": str(tiny_models.gamma)})
            assert accepted.status_code == 202
            assert accepted.json() == {
                "status": "loading", "model_id": "gamma", "model_path": str(tiny_models.gamma), "model_type": "lm"
            }
            loading = await http.post("/v1/chat/completions", json={"model": "gamma", **CHAT})
            assert loading.status_code == 503 and loading.headers["retry-after"] == "5"
            assert loading.json()["error"]["code"] == "model_loading"
            listed = (await http.get("/v1/models")).json()["data"]
            assert [(m["id"], m["status"]) for m in listed] == [("gamma", "loading")]
            assert _stored_ids(tmp_path) == []  # stored once it serves: a load that never does must not come back
            not_ready = await http.get("/ready")
            assert not_ready.status_code == 503
            assert not_ready.json() == {"ready": False, "running": [], "loading": ["gamma"], "failed": []}
            assert (await http.get("/health")).json()["ready"] is False

            await wait_for(lambda: _is(stack, "gamma", "running"))
            assert _stored_ids(tmp_path) == ["gamma"]
            ready = await http.get("/ready")
            assert ready.status_code == 200
            assert ready.json() == {"ready": True, "running": ["gamma"], "loading": [], "failed": []}
            assert (await http.get("/health")).json()["ready"] is True
            answer = await http.post("/v1/chat/completions", json={"model": "gamma", **CHAT})
            assert answer.status_code == 200 and answer.json()["model"] == "gamma"

            unloading = await http.delete("/v1/admin/unload-model/gamma", headers={"Prefer": "respond-async"})
            assert unloading.status_code == 202
            assert unloading.json() == {"status": "unloading", "model_id": "gamma"}
            await wait_for(lambda: _gone(stack, "gamma"))
            gone = await http.post("/v1/chat/completions", json={"model": "gamma", **CHAT})
            assert gone.status_code == 503 and gone.json()["error"]["code"] == "no_models_loaded"  # it was the last
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
            assert (await stack.http.post("/v1/admin/load-model", json=body)).status_code == 200
            assert await _is(stack, "org/gamma", "running")

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
            answer = await http.post("/v1/admin/load-model", json={"model_id": "broken", "model_path": str(tiny_models.broken)})
            assert answer.status_code == 503 and answer.json()["error"]["code"] == "model_load_failed"
            assert "no_such_architecture" in answer.json()["error"]["message"]  # the load waited for its outcome
            assert await _is(stack, "broken", "failed")
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
            unloaded = await http.delete("/v1/admin/unload-model/broken")
            assert unloaded.status_code == 200 and unloaded.json() == {"status": "unloaded", "model_id": "broken"}
            assert await _gone(stack, "broken")  # the answer waited for the unload

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


def test_load_answers_loaded_once_the_model_serves_and_unload_once_it_is_gone(tiny_models, tmp_path):
    """Bodega's contract: load-model answers "loaded" and the model is then "immediately available"; a model loaded
    without model_id answers to its model_path too; an unload answers once the memory is freed, so the same id
    loads again at once."""
    gamma = str(tiny_models.gamma)

    async def scenario():
        async with local_stack(
            [], tmp_path, new_engine_client=slow_engine_client(0.5), model_roots=_roots(tiny_models)
        ) as stack:
            http = stack.http
            loaded = await http.post("/v1/admin/load-model", json={"model_path": gamma})
            by_path = await http.post("/v1/chat/completions", json={"model": gamma, **CHAT})
            by_id = await http.post("/v1/chat/completions", json={"model": "gamma", **CHAT})
            unloaded = await http.delete(f"/v1/admin/unload-model/{gamma}")
            gone = await _gone(stack, "gamma")
            again = await http.post("/v1/admin/load-model", json={"model_path": gamma})
            return loaded, by_path, by_id, unloaded, gone, again

    loaded, by_path, by_id, unloaded, gone, again = asyncio.run(scenario())
    assert loaded.status_code == 200
    assert loaded.json() == {"status": "loaded", "model_id": "gamma", "model_path": gamma, "model_type": "lm"}
    assert by_path.status_code == 200 and by_path.json()["model"] == gamma  # the name the request used
    assert by_id.status_code == 200 and by_id.json()["usage"]["completion_tokens"] == 3
    assert unloaded.status_code == 200 and unloaded.json() == {"status": "unloaded", "model_id": "gamma"}
    assert gone and again.status_code == 200 and again.json()["status"] == "loaded"


def test_no_model_loaded_is_503_and_an_unknown_one_among_others_404(tiny_models, tmp_path):
    """Bodega's error table: 503 means "No model loaded"; with models loaded, an unknown id stays OpenAI's 404."""
    alpha = ModelConfig(model_id="alpha", model_path=str(tiny_models.alpha))

    async def answers(configs):
        async with local_stack(configs, tmp_path) as stack:
            return await stack.http.post("/v1/chat/completions", json={"model": "raptor", **CHAT})

    none_loaded = asyncio.run(answers([]))
    unknown = asyncio.run(answers([alpha]))
    assert none_loaded.status_code == 503 and none_loaded.json()["error"]["code"] == "no_models_loaded"
    assert "No model is loaded" in none_loaded.json()["error"]["message"]
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
