"""Whole-server survival (issue 48): kill -9 of each kind of process the graph runs (a model's replica, the
embedder's replica, the RAG replica, the ingress replica; the engine child is test_serve_graph's) while requests go
on. The proxy keeps answering: a request for a model whose replica died is held by Serve for the new replica until
the ingress sees the death (its status poll), then gets 503 with Retry-After; the RAG and ingress replicas' calls are
held and served (8-12 s here). Never a hang, a 500 or a dropped connection; the other models answer all along, and
Serve starts a new process that serves again."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from deployments.config import MODEL_SERVER_DEPLOYMENT, serve_app_name
from tests.graph.conftest import GRAPH_START_S
from tests.graph.shared_graph import ALPHA, BETA, EMBEDDER, INGRESS_APP, SharedGraph
from tests.support.serving import wait_until

pytest.importorskip("sentence_transformers", reason="the 'embeddings' extra is not installed")

CHAT = {"messages": [{"role": "user", "content": "t1"}], "max_tokens": 2, "temperature": 0}


def replica_pid(app: str, deployment: str) -> int | None:
    """The pid of the Ray worker that runs the deployment's replica (Ray titles it ray::ServeReplica:APP:DEPLOYMENT)."""
    title = f"ray::ServeReplica:{app}:{deployment}".encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "cmdline").read_bytes().split(b"\0")[0] == title:
                    return int(entry.name)
            except OSError:
                continue
    return None


def chat(http: httpx.Client, model: str) -> httpx.Response:
    return http.post("/v1/chat/completions", json={"model": model, **CHAT})


def embed(http: httpx.Client) -> httpx.Response:
    return http.post("/v1/embeddings", json={"model": EMBEDDER, "input": ["a sentence"]})


def rag_list(http: httpx.Client) -> httpx.Response:
    return http.get("/v1/rag/documents")


def model_status(http: httpx.Client, model: str) -> str | None:
    listed = http.get("/v1/admin/loaded-models").json()["data"]
    return next((m["status"] for m in listed if m["id"] == model), None)


def kill_and_watch(graph: SharedGraph, app: str, deployment: str, call, bystander, model: str | None = None):
    """SIGKILL the replica, then call until it answers 200 again from a new process; every answer meanwhile is
    returned (a hang or a dropped connection fails the test), and a bystander call each round must answer 200. For
    a model, the calls start once the ingress has seen it go (until then Serve holds a call for the new replica)."""
    old = replica_pid(app, deployment)
    assert old is not None, f"no replica process for {app}:{deployment}"
    seen: list[httpx.Response] = []
    with graph.http(timeout=60) as http:
        if model is not None:
            assert model_status(http, model) == "running"  # the ingress knows its replica (its info)
        os.kill(old, signal.SIGKILL)
        if model is not None:  # the ingress tells at once, not at Serve's next health check (10 s)
            killed_at = time.monotonic()
            health = http.get("/health").json()
            assert time.monotonic() - killed_at < 1, "/health took a second or more"
            detail = next(d for d in health["models_detail"] if d["id"] == model)
            assert detail["status"] != "running" and health["status"] != "ok", health

        def served_again():
            answer = call(http)
            seen.append(answer)
            if bystander is not None:
                assert bystander(http).status_code == 200, "another part stopped answering"
            return answer.status_code == 200 and replica_pid(app, deployment) not in (None, old)

        wait_until(served_again, GRAPH_START_S, interval_s=0.2, what=f"{app}:{deployment} serving again")
        assert http.get("/health").status_code in (200, 503)
    return seen


def assert_only_retry_later(seen: list[httpx.Response], restarting: bool = False) -> None:
    """Every answer is 200 or 503 with Retry-After; `restarting`: the ones before the new replica served were 503s
    saying so."""
    if restarting:
        assert seen[0].status_code == 503 and "restarting" in seen[0].json()["error"]["message"], seen[0].text
    for answer in seen:
        if answer.status_code != 200:
            assert answer.status_code == 503, (answer.status_code, answer.text)
            assert int(answer.headers["retry-after"]) >= 1, answer.headers


def test_a_dead_model_replica_is_503_retry_after_then_serves_again(shared_graph):
    seen = kill_and_watch(shared_graph, serve_app_name(BETA), MODEL_SERVER_DEPLOYMENT,
                          lambda http: chat(http, BETA), lambda http: chat(http, ALPHA), model=BETA)
    assert_only_retry_later(seen, restarting=True)


def test_a_dead_embedder_replica_is_503_retry_after_then_serves_again(shared_graph):
    seen = kill_and_watch(shared_graph, serve_app_name(EMBEDDER), MODEL_SERVER_DEPLOYMENT, embed,
                          lambda http: chat(http, ALPHA), model=EMBEDDER)
    assert_only_retry_later(seen, restarting=True)


def test_a_dead_rag_replica_is_503_retry_after_then_serves_again(shared_graph):
    seen = kill_and_watch(shared_graph, INGRESS_APP, "RagServer", rag_list, lambda http: chat(http, ALPHA))
    assert_only_retry_later(seen)


def test_a_dead_ingress_replica_is_replaced_and_the_models_live_on(shared_graph):
    models = {m: replica_pid(serve_app_name(m), MODEL_SERVER_DEPLOYMENT) for m in (ALPHA, BETA)}
    seen = kill_and_watch(shared_graph, INGRESS_APP, "Ingress", lambda http: chat(http, ALPHA), None)
    assert_only_retry_later(seen)
    assert {m: replica_pid(serve_app_name(m), MODEL_SERVER_DEPLOYMENT) for m in models} == models
