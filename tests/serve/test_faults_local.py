"""Faults seen through HTTP, in process (the engine in its own process, as served): an engine killed with -9 makes
/health unhealthy as soon as its client sees the socket close, requests meanwhile get 503 + Retry-After, and the
model serves again; an unload answers before the drain ends, drains, and ends the streams it cuts with
model_unloaded. Checked by events and order, not elapsed time: a busy machine only makes them slower."""

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
# Bounds waits for events (a restart, a drain): only a hang reaches it, not a machine ten times slower than usual.
HANG_S = 300.0
DRAIN_S = 1.0


async def _health(http) -> dict:
    response = await http.get("/health")
    return {"code": response.status_code, **response.json()}


def test_a_killed_engine_is_unhealthy_at_once_and_serves_again(tiny_models, tmp_path):
    alpha = ModelConfig(model_id="alpha", model_path=str(tiny_models.alpha))

    async def scenario():
        async with local_stack([alpha], tmp_path, new_engine_client=process_engine_client) as stack:
            http = stack.http
            assert (await _health(http))["status"] == "ok"
            service = stack.backend._services["alpha"]
            killed_engine = service._engine._client
            os.kill(service.engine_pid, signal.SIGKILL)
            # The event: the client's reader sees the socket close. /health tells it at the very next call.
            await asyncio.wait_for(killed_engine.wait_dead(), HANG_S)
            during = await _health(http)
            refused = await http.post("/v1/chat/completions", json={"model": "alpha", **CHAT})
            metrics_during = await http.get("/metrics")  # the model's request counts still answer
            await wait_for(lambda: _is_health(http, "ok"), timeout_s=HANG_S, interval_s=0.1)
            answer = await http.post("/v1/chat/completions", json={"model": "alpha", **CHAT})
            detail = (await http.get("/v1/admin/loaded-models")).json()["data"][0]
            metrics = (await http.get("/metrics")).text
            return during, refused, answer, detail, metrics_during, metrics

    during, refused, answer, detail, metrics_during, metrics = asyncio.run(scenario())
    assert during["code"] == 503 and during["status"] == "unhealthy"
    assert during["models_detail"][0]["status"] == "unhealthy" and "engine process" in during["models_detail"][0]["error"]
    assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
    assert refused.json()["error"]["code"] == "engine_restarting"
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 3
    assert detail["status"] == "running" and detail["engine_restarts"] == 1 and detail["error"] is None
    assert metrics_during.status_code == 200
    assert 'orchard:requests_total{api="chat",model_name="alpha",status="error"} 1.0' in metrics_during.text
    assert 'orchard:engine_restarts_total{model_name="alpha"} 1.0' in metrics
    assert 'orchard:requests_total{api="chat",model_name="alpha",status="finished"} 1.0' in metrics


async def _is_health(http, status: str) -> bool:
    return (await _health(http))["status"] == status


def test_unload_without_waiting_answers_at_once_drains_and_ends_cut_streams_with_model_unloaded(tiny_models, tmp_path):
    alpha = ModelConfig(model_id="alpha", model_path=str(tiny_models.alpha), advanced={"unload_drain_s": DRAIN_S})
    # httpx's ASGI transport returns a response only once it is complete: the stream is read from the model.
    job = GenerateJob("long", TextPrompt("t1 t2"), SamplingParams(max_tokens=1900, temperature=0.0, ignore_eos=True), stream=True)

    async def scenario():
        async with local_stack([alpha], tmp_path) as stack:
            http = stack.http
            chunks = (await stack.registry.route("alpha")).generate(job)
            first = await anext(chunks)
            rest: list = []
            order: list[str] = []

            async def read_the_rest() -> None:
                async for chunk in chunks:
                    rest.append(chunk)
                order.append("stream ended")

            reading = asyncio.create_task(read_the_rest())
            asked = time.monotonic()
            unloading = await http.delete("/v1/admin/unload-model/alpha?wait=false")
            order.append("unload answered")
            read_when_answered = len(rest)
            refused = await http.post("/v1/chat/completions", json={"model": "alpha", **CHAT})
            await asyncio.wait_for(reading, HANG_S)
            cut_s = time.monotonic() - asked
            await wait_for(lambda: _no_models(http), timeout_s=HANG_S)
            return first, unloading, order, read_when_answered, refused, rest, cut_s

    first, unloading, order, read_when_answered, refused, rest, cut_s = asyncio.run(scenario())
    assert first.error is None and unloading.status_code == 202
    assert unloading.json() == {"status": "unloading", "model_id": "alpha"}
    # The DELETE ?wait=false did not wait for the drain: it answered while the stream still ran, and tokens came after it.
    assert order == ["unload answered", "stream ended"]
    assert sum(c.num_tokens for c in rest[read_when_answered:]) > 0
    assert cut_s >= DRAIN_S  # the stream had its drain time (a busy machine only makes this longer)
    assert refused.status_code == 404 and "being unloaded" in refused.json()["error"]["message"]
    assert rest[-1].error is not None and rest[-1].error.code == "model_unloaded"
    assert all(chunk.error is None for chunk in rest[:-1]) and sum(c.num_tokens for c in rest) < 1900


async def _no_models(http) -> bool:
    return (await http.get("/v1/admin/loaded-models")).json()["data"] == []


def test_a_client_gone_mid_stream_is_one_info_line_not_a_traceback(tiny_models, tmp_path):
    """Under Serve, reading from a client that went away raises TaskCancelledError (Ray's real exception here)."""
    import json
    import logging

    from ray.exceptions import TaskCancelledError

    alpha = ModelConfig(model_id="alpha", model_path=str(tiny_models.alpha))
    body = json.dumps({"model": "alpha", "messages": [{"role": "user", "content": "t1"}], "max_tokens": 1500,
                       "temperature": 0, "ignore_eos": True, "stream": True}).encode()
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "root_path": "", "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 5555), "server": ("127.0.0.1", 8000),
    }

    async def scenario():
        async with local_stack([alpha], tmp_path) as stack:
            sent: list[dict] = []
            some_chunks_out = asyncio.Event()
            reads = 0

            async def receive() -> dict:
                nonlocal reads
                reads += 1
                if reads == 1:
                    return {"type": "http.request", "body": body, "more_body": False}
                await some_chunks_out.wait()  # the client leaves mid-stream
                raise TaskCancelledError()

            async def send(message: dict) -> None:
                sent.append(message)
                if sum(1 for m in sent if m["type"] == "http.response.body" and m.get("body")) >= 2:
                    some_chunks_out.set()

            await asyncio.wait_for(stack.app(scope, receive, send), HANG_S)
            await wait_for(lambda: _idle(stack), timeout_s=HANG_S)
            return sent

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("ray.serve.orchard")  # Serve's logger does not propagate to the root
    previous_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        sent = asyncio.run(scenario())
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous_level)
    chunks = [m for m in sent if m["type"] == "http.response.body" and m.get("body")]
    assert sent[0]["status"] == 200 and chunks and b"[DONE]" not in b"".join(m["body"] for m in chunks)
    assert not [r for r in records if r.levelno >= logging.ERROR], [r.getMessage() for r in records]
    gone = [r for r in records if "client disconnected" in r.getMessage()]
    assert len(gone) == 1 and "TaskCancelledError" in gone[0].getMessage()


async def _idle(stack) -> bool:
    """The cut request was aborted in the engine: nothing runs there any more."""
    stats = (await stack.http.get("/v1/queue/stats")).json()["models"][0]
    return stats["running"] == 0 and stats["waiting"] == 0


def test_an_engine_whose_step_does_not_end_is_degraded_then_ok_again(tiny_models, tmp_path):
    alpha = ModelConfig(model_id="alpha", model_path=str(tiny_models.alpha))

    async def scenario():
        async with local_stack([alpha], tmp_path, new_engine_client=process_engine_client) as stack:
            service = stack.backend._services["alpha"]
            service._engine._client.stall_after_s = 1.0  # the derived bound is >= 10 s; the test waits less
            os.kill(service.engine_pid, signal.SIGSTOP)  # as a step that runs on and on
            try:
                await wait_for(lambda: _is_health(stack.http, "degraded"), timeout_s=HANG_S, interval_s=0.1)
                degraded = await _health(stack.http)
            finally:
                os.kill(service.engine_pid, signal.SIGCONT)
            await wait_for(lambda: _is_health(stack.http, "ok"), timeout_s=HANG_S, interval_s=0.1)
            return degraded

    degraded = asyncio.run(scenario())
    assert degraded["code"] == 200 and degraded["models_detail"][0]["status"] == "degraded"
    assert "No engine step has ended for" in degraded["models_detail"][0]["error"]
