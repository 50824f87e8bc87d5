"""The real graph: serve_config.yaml's applications (with tiny models) on Ray Serve, driven by the openai client; the
session's shared graph (tests/graph/shared_graph.py), whose other models these tests leave alone.

Run inside a loopback-only network namespace (scripts/loopback.sh): Ray binds the host interface
otherwise. Everything here talks to 127.0.0.1 only; one Ray instance serves the whole session.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import threading
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deployments.config import MODEL_SERVER_DEPLOYMENT, serve_app_name
from tests.graph.conftest import GRAPH_START_S
from tests.support.serving import wait_until
from tests.graph.shared_graph import ALPHA, ALPHA_CONTEXT, BETA, INGRESS_APP
from tests.graph.shared_graph import SharedGraph as Graph
from tests.support.sockets import listening_sockets

GAMMA = "tiny/gamma"
BROKEN = "tiny-broken"
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
CHAT = [{"role": "user", "content": "t1 t2 t3"}]
LONG = 60000  # max_tokens of streams the tests hold open (never reached)


@pytest.fixture(scope="module")
def graph(shared_graph) -> Graph:
    """The shared graph: alpha (context cut to 4096, streams over its stream channel) and beta (at most 2 requests,
    streams through Ray's handle) among its models."""
    return shared_graph


def _queue_row(http: httpx.Client, model_id: str) -> dict:
    rows = http.get("/v1/queue/stats").json()["models"]
    return next(r for r in rows if r["id"] == model_id)


def _status_of(http: httpx.Client, model_id: str) -> dict | None:
    data = http.get("/v1/admin/loaded-models").json()["data"]
    return next((m for m in data if m["id"] == model_id), None)


# ---- generation -------------------------------------------------------------------------------
def test_chat_streamed_text_equals_non_streamed(graph):
    with graph.http() as http:
        channel_streams_before = _queue_row(http, ALPHA)["stream_channel_streams_total"]
    client = graph.openai()
    full = client.chat.completions.create(model=ALPHA, messages=CHAT, max_tokens=24, **GREEDY)
    assert full.object == "chat.completion" and full.model == ALPHA and full.id.startswith("chatcmpl-")
    assert full.choices[0].finish_reason == "length" and full.choices[0].message.role == "assistant"
    assert full.usage.completion_tokens == 24
    assert full.usage.total_tokens == full.usage.prompt_tokens + 24
    assert full.usage.prompt_tokens_details.cached_tokens >= 0

    chunks = list(client.chat.completions.create(
        model=ALPHA, messages=CHAT, max_tokens=24, stream=True, stream_options={"include_usage": True}, **GREEDY
    ))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert all(c.usage is None for c in chunks[:-1])
    content_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content_chunks) < 24, "tokens should be coalesced into fewer chunks"
    with graph.http() as http:  # both went over alpha's stream channel, not Ray's handle stream
        assert _queue_row(http, ALPHA)["stream_channel_streams_total"] == channel_streams_before + 2
        assert _queue_row(http, BETA)["stream_channel_streams_total"] is None


def test_completions_streamed_text_equals_non_streamed(graph):
    client = graph.openai()
    full = client.completions.create(model=BETA, prompt="t5 t6 t7", max_tokens=16, **GREEDY)
    assert full.object == "text_completion" and full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 16
    chunks = list(client.completions.create(model=BETA, prompt="t5 t6 t7", max_tokens=16, stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage anywhere


def test_two_models_serve_at_once(graph):
    async def scenario():
        client = graph.async_openai()
        return await asyncio.gather(
            client.chat.completions.create(model=ALPHA, messages=CHAT, max_tokens=12, **GREEDY),
            client.chat.completions.create(model=BETA, messages=CHAT, max_tokens=12, **GREEDY),
            client.chat.completions.create(model=ALPHA, messages=CHAT, max_tokens=12, **GREEDY),
        )

    alpha, beta, alpha_again = asyncio.run(scenario())
    assert (alpha.model, beta.model) == (ALPHA, BETA)
    assert alpha.choices[0].message.content == alpha_again.choices[0].message.content
    assert alpha.choices[0].message.content != beta.choices[0].message.content  # different weights
    listed = {m.id for m in graph.openai().models.list().data}
    assert {ALPHA, BETA} <= listed


# ---- admin ------------------------------------------------------------------------------------
def test_load_through_admin_chat_unload_then_404(graph, tiny_models):
    client = graph.openai()
    with graph.http() as http:
        beta_stream = _BackgroundStream(graph, BETA)
        beta_stream.start()
        accepted = http.post("/v1/admin/load-model?wait=false", json={  # answers at once: watch it load
            "model_id": GAMMA, "model_path": str(tiny_models.gamma), "cb_max_num_seqs": 8,
            "advanced": {"unload_drain_s": 0},
        })
        assert accepted.status_code == 202, accepted.text
        assert accepted.json() == {
            "status": "loading", "model_id": GAMMA, "model_path": str(tiny_models.gamma), "model_type": "lm"
        }
        # The replica takes seconds to start: a request now is told to come back.
        loading = http.post("/v1/chat/completions", json={"model": GAMMA, "messages": CHAT})
        assert loading.status_code == 503 and int(loading.headers["retry-after"]) > 0
        assert loading.json()["error"]["code"] == "model_loading"
        assert GAMMA not in _stored_ids(graph)  # kept once it serves: a load that never does must not come back

        chunks_at_accept = beta_stream.chunks
        wait_until(lambda: (_status_of(http, GAMMA) or {}).get("status") == "running", GRAPH_START_S,
                   what="gamma running")
        assert GAMMA in _stored_ids(graph)
        beta_stream.stop()
        # The deploy ran off the ingress's event loop: beta's stream kept flowing while gamma loaded.
        assert beta_stream.chunks - chunks_at_accept >= 5, f"a stream on {BETA} stalled while {GAMMA} loaded"

        answer = client.chat.completions.create(model=GAMMA, messages=CHAT, max_tokens=5, **GREEDY)
        assert answer.model == GAMMA and answer.usage.completion_tokens == 5

        _kill_engine_and_see_it_restart(graph, http)
        _unload_cuts_a_stream_with_model_unloaded(graph, http)
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model=GAMMA, messages=CHAT, max_tokens=5)
    assert missing.value.body["code"] == "model_not_found"
    assert GAMMA not in _stored_ids(graph)
    assert client.chat.completions.create(model=ALPHA, messages=CHAT, max_tokens=3).choices[0].message.content


def _kill_engine_and_see_it_restart(graph: Graph, http: httpx.Client) -> None:
    """kill -9 of gamma's engine process: /health says so (the replica's engine client sees the socket close: the
    engine tests check that this is an event, not a poll), gamma answers 503 + Retry-After, the others serve on,
    and gamma serves again with a new engine process."""
    engine_pid = _status_of(http, GAMMA)["engine_pid"]
    os.kill(engine_pid, signal.SIGKILL)
    detail = wait_until(lambda: _health_detail(http, GAMMA, "unhealthy"), GRAPH_START_S, what="gamma unhealthy",
                        interval_s=0.02)
    assert "engine process" in detail["error"]
    assert http.get("/health").json()["status"] == "degraded"  # alpha and beta serve on
    refused = http.post("/v1/chat/completions", json={"model": GAMMA, "messages": CHAT, "max_tokens": 2})
    assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1, refused.text
    assert refused.json()["error"]["code"] == "engine_restarting"
    wait_until(lambda: _health_detail(http, GAMMA, "running"), GRAPH_START_S, what="gamma restarted")
    status = _status_of(http, GAMMA)
    assert status["engine_restarts"] == 1 and status["engine_pid"] != engine_pid
    answer = graph.openai().chat.completions.create(model=GAMMA, messages=CHAT, max_tokens=3, **GREEDY)
    assert answer.usage.completion_tokens == 3


def _health_detail(http: httpx.Client, model_id: str, status: str) -> dict | None:
    details = http.get("/health").json()["models_detail"]
    return next((d for d in details if d["id"] == model_id and d["status"] == status), None)


def _unload_cuts_a_stream_with_model_unloaded(graph: Graph, http: httpx.Client) -> None:
    """DELETE ?wait=false answers at once: before Serve has deleted gamma (seconds), which it leaves to the
    background; a stream it cuts (gamma drains for 0 s) ends with a model_unloaded error event."""
    body = {"model": GAMMA, "messages": CHAT, "max_tokens": LONG, "stream": True, "temperature": 0, "ignore_eos": True}
    with graph.http() as streaming, streaming.stream("POST", "/v1/chat/completions", json=body) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        unloading = http.delete(f"/v1/admin/unload-model/{GAMMA}?wait=false")
        assert unloading.status_code == 202 and unloading.json() == {"status": "unloading", "model_id": GAMMA}
        assert (_status_of(http, GAMMA) or {}).get("status") == "unloading"  # the answer did not wait for the delete
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert "error" in events[-1] and events[-1]["error"]["code"] == "model_unloaded", events[-1]
    wait_until(lambda: _status_of(http, GAMMA) is None, GRAPH_START_S, what="gamma unloaded")


def test_failed_load_reports_why_and_others_keep_serving(graph, tiny_models):
    client = graph.openai()
    with graph.http() as http:
        # The load waits for its outcome: the deploy's failure, with the reason.
        answer = http.post("/v1/admin/load-model", json={"model_id": BROKEN, "model_path": str(tiny_models.broken)},
                           timeout=GRAPH_START_S)
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "model_load_failed", answer.text
        assert "no_such_architecture" in answer.json()["error"]["message"]
        failed = _status_of(http, BROKEN)
        assert failed["status"] == "failed" and "no_such_architecture" in failed["error"]
        refused = http.post("/v1/chat/completions", json={"model": BROKEN, "messages": CHAT})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "model_load_failed"
        assert client.chat.completions.create(model=ALPHA, messages=CHAT, max_tokens=3).choices[0].message.content
        unloaded = http.delete(f"/v1/admin/unload-model/{BROKEN}", timeout=GRAPH_START_S)
        assert unloaded.status_code == 200 and unloaded.json() == {"status": "unloaded", "model_id": BROKEN}
        assert _status_of(http, BROKEN) is None  # the answer waited for the delete


def test_admin_refuses_unsafe_or_unknown_load_bodies(graph, tiny_models):
    gamma = str(tiny_models.gamma)
    with graph.http() as http:
        cases = [
            ({"model_path": gamma, "model_id": INGRESS_APP}, "model_id"),  # would replace the ingress
            ({"model_path": gamma, "model_id": "x", "trust_remote_code": True}, "trust_remote_code"),
            ({"model_path": gamma, "model_id": "x", "chat_template_file": "/etc/passwd"}, "chat_template_file"),
            ({"model_path": gamma, "model_id": "m" * 256}, "model_id"),
            ({"model_path": "/etc", "model_id": "x"}, "model_path"),  # outside model_roots
            ({"model_path": f"{tiny_models.alpha}/../alpha"}, "model_path"),
            ({"model_path": str(tiny_models.alpha / "config.json")}, "model_path"),
            ({"model_path": "relative/folder/x"}, "model_path"),  # neither a repo id (owner/name) nor absolute
            ({"model_path": str(tiny_models.alpha), "model_id": "x", "warp_speed": 9}, "warp_speed"),
            ({"model_path": str(tiny_models.alpha), "model_id": ALPHA}, "model_id"),  # already loaded
        ]
        for body, param in cases:
            response = http.post("/v1/admin/load-model", json=body)
            assert response.status_code in (400, 409), (body, response.text)
            assert response.json()["error"]["param"] == param, response.text
        assert http.delete("/v1/admin/unload-model/no-such-model").status_code == 404
        assert INGRESS_APP not in _stored_ids(graph) and "x" not in _stored_ids(graph)
        # On main, a load named "orchard" had replaced the ingress (every route 404) within 5 s. A load the checks
        # let through is listed at once (status loading, before its deploy starts): none is, so none will deploy.
        listed = {m["id"] for m in http.get("/v1/admin/loaded-models").json()["data"]}
        assert listed.isdisjoint({INGRESS_APP, "x", "m" * 256}), listed
        assert http.get("/health").status_code == 200
        assert graph.openai().chat.completions.create(model=ALPHA, messages=CHAT, max_tokens=2).choices


# ---- operational routes -------------------------------------------------------------------------
def test_health_queue_stats_and_loaded_models_shapes(graph):
    with graph.http() as http:
        health = http.get("/health")
        assert health.status_code == 200
        body = health.json()
        assert body["status"] == "ok" and body["model_status"].startswith("initialized (")
        assert {ALPHA, BETA} <= set(body["model_id"].split(", "))
        detail = {d["id"]: d for d in body["models_detail"]}[ALPHA]
        assert detail["type"] == "lm" and detail["status"] == "running" and detail["ram_usage_mb"] > 10

        stats = http.get("/v1/queue/stats").json()
        assert set(stats["queue_stats"]) == {"queue_size", "active_requests", "models"}
        row = _queue_row(http, BETA)
        assert row["max_num_seqs"] == 2 and row["queue_capacity"] is not None and row["tokens_per_s"] >= 0

        loaded = http.get("/v1/admin/loaded-models").json()
        assert loaded["object"] == "list" and loaded["total"] == len(loaded["data"])
        alpha = next(m for m in loaded["data"] if m["id"] == ALPHA)
        assert alpha["type"] == "lm" and alpha["context_length"] == ALPHA_CONTEXT and alpha["status"] == "running"
        assert isinstance(alpha["pid"], int) and alpha["created_at"] > 1_600_000_000
        assert set(alpha["memory"]) == {"metal_active_mb", "metal_cache_mb", "metal_peak_mb", "rss_mb", "total_mb"}
        assert alpha["memory"]["rss_mb"] > 10


def test_the_ingress_reads_serve_status_as_serve_status_does(graph):
    """The ingress builds serve.status()'s view from the controller's details without validating them whole
    (deployments/ingress/serve_models.py): the same view of every application of the running graph."""
    from ray import serve

    from deployments.ingress.serve_models import serve_status

    def same_view():  # the two reads are a moment apart: a replica may change state between them
        ours = serve_status()
        return ours if ours.applications == serve.status().applications else None

    ours = wait_until(same_view, 30, interval_s=1, what="the ingress's view of Serve's status equal to serve.status's")
    assert {INGRESS_APP, serve_app_name(ALPHA), serve_app_name(BETA)} <= set(ours.applications)
    assert ours.applications[serve_app_name(ALPHA)].deployments[MODEL_SERVER_DEPLOYMENT].replica_states == {
        "RUNNING": 1}


def _metric_samples(http: httpx.Client) -> dict[tuple[str, tuple], float]:
    page = http.get("/metrics")
    assert page.status_code == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(page.text) for s in family.samples}


def test_metrics_page_gathers_the_ingress_and_each_model_replica(graph):
    """Counted in the ingress (requests by API) and in the model's replica (tokens, latencies), across Ray."""
    labels = (("api", "completions"), ("model_name", BETA), ("status", "finished"))
    with graph.http() as http:
        before = _metric_samples(http)
        reply = graph.openai().completions.create(model=BETA, prompt="t5 t6", max_tokens=3, **GREEDY)
        after = _metric_samples(http)
    requests = ("orchard:requests_total", labels)
    assert after[requests] - before.get(requests, 0) == 1
    generated = ("orchard:generation_tokens_total", (("model_name", BETA),))
    assert after[generated] - before.get(generated, 0) == reply.usage.completion_tokens
    ttft = ("orchard:time_to_first_token_seconds_count", (("model_name", BETA),))
    assert after[ttft] - before.get(ttft, 0) == 1
    for model in (ALPHA, BETA):
        assert after[("orchard:num_requests_running", (("model_name", model),))] >= 0
        assert after[("orchard:memory_bytes", (("kind", "rss"), ("model_name", model)))] > 0
    # The same recordings reach Ray's metrics export (its names: ray_ + orchard_ + vLLM's).
    import ray

    port = ray._private.worker.global_worker.node.metrics_export_port
    wanted = ("ray_orchard_requests_total", "ray_orchard_time_to_first_token_seconds_count")

    def ray_exported() -> bool:
        page = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        families = {s.name for family in text_string_to_metric_families(page) for s in family.samples
                    if s.labels.get("model_name") == BETA}
        return all(name in families for name in wanted)

    wait_until(ray_exported, 60, interval_s=1.0, what="Orchard's metrics in Ray's export")


def test_request_id_is_echoed(graph):
    with graph.http() as http:
        response = http.get("/v1/models", headers={"X-Request-Id": "orchard-test-42"})
        assert response.headers["x-request-id"] == "orchard-test-42"
        assert http.get("/v1/models").headers["x-request-id"]  # generated when absent


# ---- network exposure -------------------------------------------------------------------------------
@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's /proc/net/tcp")
def test_every_socket_of_the_cluster_listens_on_loopback_only(graph):
    """Ray's processes (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0) and each replica's inter-deployment gRPC server
    (deployments/ray_loopback.py) listen on loopback only; scripts/test.sh gives this namespace a host-like
    address too, which Ray would otherwise take as its node IP and bind."""
    from ray import serve

    listeners = listening_sockets()
    beyond_loopback = [s for s in listeners if not s.is_loopback]
    assert beyond_loopback == [], "listening beyond loopback:\n" + "\n".join(map(str, beyond_loopback))
    assert any(s.port == graph.cluster.port for s in listeners)  # Serve's HTTP port: the list is this namespace's
    for deployment in (f"{INGRESS_APP}:Ingress", f"{serve_app_name(BETA)}:{MODEL_SERVER_DEPLOYMENT}"):
        replica = f"ServeReplica:{deployment}"
        assert any(replica in s.process for s in listeners), f"no socket of {replica} in {listeners}"
    # The rebound gRPC server still answers: a handle call that goes over it instead of Ray's object store.
    handle = serve.get_deployment_handle(MODEL_SERVER_DEPLOYMENT, app_name=serve_app_name(BETA))
    assert handle.options(_by_reference=False).info.remote().result(timeout_s=60).model_id == BETA


# ---- errors ---------------------------------------------------------------------------------------
def test_error_statuses_and_bodies(graph):
    client = graph.openai()
    with pytest.raises(openai.NotFoundError) as not_found:
        client.chat.completions.create(model="no-such-model", messages=CHAT)
    assert not_found.value.body == {
        "message": "The model 'no-such-model' does not exist", "type": "invalid_request_error",
        "param": "model", "code": "model_not_found",
    }
    with pytest.raises(openai.BadRequestError) as too_long:
        client.chat.completions.create(model=ALPHA, messages=[{"role": "user", "content": "t1 " * ALPHA_CONTEXT}])
    assert too_long.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as too_many:
        client.chat.completions.create(model=ALPHA, messages=CHAT, max_tokens=ALPHA_CONTEXT)
    assert too_many.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as n_two:
        client.chat.completions.create(model=ALPHA, messages=CHAT, n=2)
    assert n_two.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as json_mode:
        client.chat.completions.create(model=ALPHA, messages=CHAT, response_format={"type": "json_object"})
    assert json_mode.value.body["param"] == "response_format"


def test_queue_full_is_429_and_closed_streams_free_their_slots(graph):
    body = {"model": BETA, "messages": CHAT, "stream": True, "max_tokens": LONG, "ignore_eos": True}
    with graph.http() as http, contextlib.ExitStack() as held:
        open_lines = []
        for _ in range(2):  # beta holds 2 requests at most
            stream = held.enter_context(http.stream("POST", "/v1/chat/completions", json=body))
            assert stream.status_code == 200
            open_lines.append(stream.iter_lines())
            _read_to_first_content(open_lines[-1])
        # Engine stats are refreshed every 0.2 s while it works.
        wait_until(lambda: _queue_row(http, BETA)["running"] == 2, 60, what="both streams running")
        refused = http.post("/v1/chat/completions", json=body)
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "queue_full" and refused.headers["retry-after"] == "1"
    # Both streams were closed mid-generation: the engine aborts them and frees their KV.
    with graph.http() as http:
        wait_until(lambda: _queue_row(http, BETA)["running"] == 0, 60, what="beta idle")


def test_disconnected_stream_is_aborted_in_the_engine(graph):
    max_tokens = ALPHA_CONTEXT - 100
    with graph.http() as http:
        before = _queue_row(http, ALPHA)["generation_tokens_total"]
        body = {"model": ALPHA, "messages": CHAT, "stream": True, "max_tokens": max_tokens, "ignore_eos": True}
        with http.stream("POST", "/v1/chat/completions", json=body) as stream:
            lines = stream.iter_lines()
            _read_to_first_content(lines)
            wait_until(
                lambda: (row := _queue_row(http, ALPHA))["running"] == 1 and row["kv_cache_bytes"] > 0,
                10, what="the stream's KV in use",
            )
        idle = wait_until(
            lambda: (row := _queue_row(http, ALPHA))["running"] == 0 and row["kv_cache_bytes"] == 0 and row,
            20, what="alpha's KV freed",
        )
        # One stats snapshot: nothing runs or waits, and the tokens made so far are all there will be. An unaborted
        # request would have kept running, to its max_tokens, before alpha read idle.
        generated = idle["generation_tokens_total"] - before
        assert generated < max_tokens, "the request ran to completion instead of being aborted"
        assert idle["waiting"] == 0


# ---- helpers ---------------------------------------------------------------------------------------
def _read_to_first_content(lines: Iterator[str]) -> str:
    """Keep `lines` referenced while the stream should stay open: dropping httpx's line iterator
    closes the connection (which the server rightly treats as a disconnect)."""
    for line in lines:
        if line.startswith("data: {") and '"content":"t' in line:
            return line
    raise AssertionError("the stream ended before any content")


def _stored_ids(graph: Graph) -> set[str]:
    if not (graph.state_dir / "models.json").exists():
        return set()
    stored = json.loads((graph.state_dir / "models.json").read_text())
    return {m["model_id"] for m in stored["models"]}


class _BackgroundStream(threading.Thread):
    """Streams from a model in the background until stopped; counts its chunks."""

    def __init__(self, graph: Graph, model_id: str) -> None:
        super().__init__(daemon=True)
        self._client = graph.openai()
        self._model_id = model_id
        self._stop_event = threading.Event()
        self.chunks = 0

    def run(self) -> None:
        stream = self._client.chat.completions.create(
            model=self._model_id, messages=CHAT, max_tokens=LONG, stream=True, **GREEDY
        )
        with stream:
            for _ in stream:
                self.chunks += 1
                if self._stop_event.is_set():
                    return

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=30)
