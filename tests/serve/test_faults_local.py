"""Faults seen through HTTP, in process (the engine in its own process, as served): an engine killed with -9 makes
/health unhealthy within 1 s, requests meanwhile get 503 + Retry-After, and the model serves again within its load
time + 5 s; an unload answers at once, drains, and ends the streams it cuts with model_unloaded."""

from __future__ import annotations

import asyncio
import os
import signal
import time

from deployments.config import ModelConfig
from deployments.model.service import process_engine_client
from deployments.model_calls import GenerateJob, TextPrompt
from engine.sampling.params import SamplingParams
from tests.serve.local_stack import local_stack, wait_for

CHAT = {"messages": [{"role": "user", "content": "t1"}], "max_tokens": 3, "temperature": 0}
RESTART_SLACK_S = 5.0


async def _health(http) -> dict:
    response = await http.get("/health")
    return {"code": response.status_code, **response.json()}


async def _until(predicate, timeout_s: float, interval_s: float = 0.02) -> float:
    """Seconds until predicate() (a coroutine function) is true; fails past timeout_s."""
    started = time.monotonic()
    while not await predicate():
        assert time.monotonic() - started < timeout_s, f"not within {timeout_s} s"
        await asyncio.sleep(interval_s)
    return time.monotonic() - started


def test_a_killed_engine_is_unhealthy_within_a_second_and_serves_again_within_its_load_time(tiny_models, tmp_path):
    alpha = ModelConfig(model_id="alpha", model_path=str(tiny_models.alpha))

    async def scenario():
        loading = time.monotonic()
        async with local_stack([alpha], tmp_path, new_engine_client=process_engine_client) as stack:
            load_s = time.monotonic() - loading
            http = stack.http
            assert (await _health(http))["status"] == "ok"
            service = stack.backend._services["alpha"]
            os.kill(service.engine_pid, signal.SIGKILL)
            unhealthy_s = await _until(lambda: _is_health(http, "unhealthy"), timeout_s=1.0)
            during = await _health(http)
            refused = await http.post("/v1/chat/completions", json={"model": "alpha", **CHAT})
            back_s = await _until(lambda: _is_health(http, "ok"), timeout_s=load_s + RESTART_SLACK_S, interval_s=0.1)
            answer = await http.post("/v1/chat/completions", json={"model": "alpha", **CHAT})
            detail = (await http.get("/v1/admin/loaded-models")).json()["data"][0]
            return unhealthy_s, during, refused, back_s, answer, detail

    unhealthy_s, during, refused, back_s, answer, detail = asyncio.run(scenario())
    assert unhealthy_s < 1.0 and during["code"] == 503
    assert during["models_detail"][0]["status"] == "unhealthy" and "engine process" in during["models_detail"][0]["error"]
    assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
    assert refused.json()["error"]["code"] == "engine_restarting"
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 3
    assert detail["status"] == "running" and detail["engine_restarts"] == 1 and detail["error"] is None


async def _is_health(http, status: str) -> bool:
    return (await _health(http))["status"] == status


def test_unload_answers_at_once_drains_and_ends_cut_streams_with_model_unloaded(tiny_models, tmp_path):
    alpha = ModelConfig(model_id="alpha", model_path=str(tiny_models.alpha), advanced={"unload_drain_s": 1.0})
    # httpx's ASGI transport returns a response only once it is complete: the stream is read from the model.
    job = GenerateJob("long", TextPrompt("t1 t2"), SamplingParams(max_tokens=1900, temperature=0.0, ignore_eos=True), stream=True)

    async def scenario():
        async with local_stack([alpha], tmp_path) as stack:
            http = stack.http
            chunks = (await stack.registry.route("alpha")).generate(job)
            first = await anext(chunks)
            asked = time.monotonic()
            unloading = await http.delete("/v1/admin/unload-model/alpha")
            answered_s = time.monotonic() - asked
            refused = await http.post("/v1/chat/completions", json={"model": "alpha", **CHAT})
            rest = [chunk async for chunk in chunks]
            cut_s = time.monotonic() - asked
            await wait_for(lambda: _no_models(http))
            return first, unloading, answered_s, refused, rest, cut_s

    first, unloading, answered_s, refused, rest, cut_s = asyncio.run(scenario())
    assert first.error is None and unloading.json() == {"status": "unloading", "model_id": "alpha"}
    assert answered_s < 0.5 and 1.0 <= cut_s < 5.0
    assert refused.status_code == 404 and "being unloaded" in refused.json()["error"]["message"]
    assert rest[-1].error is not None and rest[-1].error.code == "model_unloaded"
    assert all(chunk.error is None for chunk in rest[:-1]) and sum(c.num_tokens for c in rest) < 1900


async def _no_models(http) -> bool:
    return (await http.get("/v1/admin/loaded-models")).json()["data"] == []
