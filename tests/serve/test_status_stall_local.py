"""Serve's controller answering slowly (issue 48: busy with a failing deployment, its status took minutes) must not
hold the ingress: a request for an unknown model is a 404 at once (images or not), an admin load of a folder without
config.json a 400, /health, /ready, /metrics, /v1/queue/stats and loaded-models answer from the last view, and a known
model still serves. The stall is the
backend's status call held open on an event; the ingress is the real one."""

from __future__ import annotations

import asyncio

from deployments.config import ModelConfig
from deployments.ingress.status_refresh import MIN_REFRESH_INTERVAL_S
from tests.serve.local_stack import local_stack

PIXEL = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5E"
         "rkJggg==")
CHAT = {"messages": [{"role": "user", "content": "t1"}], "max_tokens": 3, "temperature": 0}


def test_a_stalled_serve_status_holds_no_route(tiny_models, tmp_path) -> None:
    alpha = ModelConfig(model_id="alpha", model_path=str(tiny_models.alpha))
    no_config = tmp_path / "no-config-here"  # under model_roots, holding no config.json
    no_config.mkdir()

    async def scenario():
        async with local_stack([alpha], model_roots=[str(tmp_path)]) as stack:
            stack.registry._status.wait_s = 0.2  # the bound a caller waits for a fresh view (2 s when served)
            released, held_calls = asyncio.Event(), []
            answer_status = stack.backend.deployments

            async def stalled():
                held_calls.append(1)
                await released.wait()
                return await answer_status()

            stack.backend.deployments = stalled
            await asyncio.sleep(MIN_REFRESH_INTERVAL_S)  # the last view is due for a refresh
            http = stack.http
            unknown = await http.post("/v1/chat/completions", json={**CHAT, "model": "nope", "messages": [
                {"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                             {"type": "image_url", "image_url": {"url": PIXEL}}]}]})
            answers = {
                "unknown": unknown,
                "health": await http.get("/health"),
                "ready": await http.get("/ready"),
                "metrics": await http.get("/metrics"),
                "queue": await http.get("/v1/queue/stats"),
                "loaded": await http.get("/v1/admin/loaded-models"),
                "bad load": await http.post("/v1/admin/load-model", json={"model_path": str(no_config)}),
                "alpha": await http.post("/v1/chat/completions", json={**CHAT, "model": "alpha"}),
            }
            still_held = not released.is_set() and len(held_calls) >= 1
            released.set()
            return answers, still_held

    answers, still_held = asyncio.run(scenario())
    assert still_held  # every answer above came while Serve's status was held
    assert answers["unknown"].status_code == 404 and answers["unknown"].json()["error"]["param"] == "model"
    assert answers["bad load"].status_code == 400 and "config.json" in answers["bad load"].json()["error"]["message"]
    for name in ("health", "ready", "metrics", "queue", "loaded", "alpha"):
        assert answers[name].status_code == 200, (name, answers[name].text)
    assert answers["alpha"].json()["usage"]["completion_tokens"] == 3
