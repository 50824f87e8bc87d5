"""RAG through the real graph (serve_config.yaml on Ray Serve, the session's shared graph): the RAG deployment beside
the ingress reaches the embedded all-MiniLM-L6-v2 and a tiny chat model through their Serve handles. Uploads, answers
streamed and not, parallel uploads and queries, a 200 MB upload refused before it is read, and a restart of the ingress
(the last test of the shared graph) that leaves the documents and the answers as they were, and brings back a model
loaded through the admin API."""

from __future__ import annotations

import hashlib
import json
import socket
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytest.importorskip("sentence_transformers", reason="the 'embeddings' extra is not installed")

from deployments.config import serve_app_name  # noqa: E402
from tests.support.town_guide import town_guide_pdf  # noqa: E402
from tests.graph.conftest import GRAPH_START_S, deploy_graph, model_running  # noqa: E402
from tests.support.serving import wait_until  # noqa: E402
from tests.graph.shared_graph import ALPHA as CHAT_MODEL  # noqa: E402
from tests.graph.shared_graph import EMBEDDER, INGRESS_APP, SharedGraph  # noqa: E402
from tests.support.pdfs import make_pdf  # noqa: E402

LOADED_MODEL = "tiny/gamma"  # loaded through the admin API: the ingress restores it after a restart
TWO_HUNDRED_MB = 200 * 1024 * 1024
PARALLEL_UPLOADS = 10
QUESTION = "Which platform does the night train leave from?"


@pytest.fixture(scope="module")
def rag_graph(shared_graph) -> SharedGraph:
    """The shared graph: its ingress's RAG deployment keeps documents in a temporary folder and answers with
    tiny/alpha (context 4096); admin loads take folders under the tiny models' folder."""
    return shared_graph


def http_client(graph: SharedGraph) -> httpx.Client:
    return httpx.Client(base_url=graph.url, timeout=300)


def upload(http: httpx.Client, filename: str, data: bytes) -> httpx.Response:
    return http.post("/v1/rag/upload", files={"file": (filename, data, "application/octet-stream")})


def answer_pair(http: httpx.Client, file_id: str) -> tuple[dict, str]:
    """The answer as one body, and the streamed answer's text (its events as sent)."""
    body = {"file_id": file_id, "query": QUESTION, "top_k": 3, "model": CHAT_MODEL, "temperature": 0, "max_tokens": 12}
    whole = http.post("/v1/rag/query", json=body)
    assert whole.status_code == 200, whole.text
    streamed = http.post("/v1/rag/query", json={**body, "stream": True})
    assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
    return whole.json(), streamed.text


def streamed_content(text: str) -> tuple[list[dict], str]:
    events = [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    payloads = [json.loads(e) for e in events[:-1]]
    return payloads, "".join(p["choices"][0]["delta"].get("content") or "" for p in payloads if p["choices"])


def test_upload_and_answer_through_the_graph(rag_graph):
    guide = town_guide_pdf()
    with http_client(rag_graph) as http:
        uploaded = upload(http, "town-guide.pdf", guide)
        assert uploaded.status_code == 200, uploaded.text
        document = uploaded.json()
        assert document["file_id"] == hashlib.sha256(guide).hexdigest() and document["status"] == "indexed"
        assert (document["num_pages"], document["filename"]) == (10, "town-guide.pdf")
        whole, streamed = answer_pair(http, document["file_id"])
        broken = upload(http, "broken.pdf", b"%PDF-1.7 not really")
        unknown = http.post("/v1/rag/query", json={"file_id": "a" * 64, "query": QUESTION, "retrieval_only": True})
    assert whole["sources"][0]["page"] == 7 and "platform nine" in whole["sources"][0]["text"]
    assert whole["choices"][0]["finish_reason"] in ("stop", "length") and whole["model"] == CHAT_MODEL
    events, text = streamed_content(streamed)
    assert events[0]["sources"] == whole["sources"]
    assert text == whole["choices"][0]["message"]["content"]
    assert broken.status_code == 400 and broken.json()["error"]["code"] == "malformed_document"
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "document_not_found"


def test_parallel_uploads_and_queries_leave_consistent_indexes(rag_graph):
    """Ten documents, each with one fact of its own, uploaded at once while queries run: every one is listed,
    whole, and its fact is its own top hit."""
    facts = [f"The secret code of vault {n} is {n * 7919} and it opens on day {n + 3}." for n in range(PARALLEL_UPLOADS)]
    files = [(f"vault-{n}.pdf", make_pdf([[facts[n], "Nothing else is kept in this vault."]])) for n in range(PARALLEL_UPLOADS)]
    with http_client(rag_graph) as http:
        guide_id = upload(http, "town-guide.pdf", town_guide_pdf()).json()["file_id"]
        query = {"file_id": guide_id, "query": QUESTION, "top_k": 1, "retrieval_only": True}
        with ThreadPoolExecutor(PARALLEL_UPLOADS * 2) as pool:
            uploads = [pool.submit(upload, http, name, data) for name, data in files]
            queries = [pool.submit(http.post, "/v1/rag/query", json=query) for _ in range(PARALLEL_UPLOADS)]
            uploaded = [future.result() for future in uploads]
            queried = [future.result() for future in queries]
        listed = {d["file_id"]: d for d in http.get("/v1/rag/documents").json()["data"]}
        own_hits = [
            http.post("/v1/rag/query", json={"file_ids": [r.json()["file_id"] for r in uploaded],
                                             "query": f"What is the secret code of vault {n}?", "top_k": 1,
                                             "retrieval_only": True}).json()["sources"][0]
            for n in range(PARALLEL_UPLOADS)
        ]
    assert [r.status_code for r in uploaded] == [200] * PARALLEL_UPLOADS
    assert all(q.status_code == 200 and q.json()["sources"][0]["page"] == 7 for q in queried)
    for (name, data), response in zip(files, uploaded):
        file_id = response.json()["file_id"]
        assert file_id == hashlib.sha256(data).hexdigest()
        assert listed[file_id]["filename"] == name and listed[file_id]["num_chunks"] == response.json()["num_chunks"] >= 1
    assert [hit["filename"] for hit in own_hits] == [name for name, _ in files]


def test_a_200_mb_upload_is_refused_before_it_is_read(rag_graph):
    """The client announces 200 MB and sends a first megabyte: the 413 comes at once, naming the limit (at once:
    with 199 MB never sent, an answer at all shows the body was not read; the socket's timeout bounds a hang)."""
    head = (
        f"POST /v1/rag/upload HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: multipart/form-data; boundary=x\r\n"
        f"Content-Length: {TWO_HUNDRED_MB}\r\nConnection: close\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", rag_graph.port), timeout=60) as sock:
        sock.sendall(head + b"x" * (1024 * 1024))
        received = b""
        while b"\r\n\r\n" not in received or not received.rstrip().endswith(b"}"):
            data = sock.recv(65536)
            if not data:
                break
            received += data
    status_line, _, rest = received.partition(b"\r\n")
    body = json.loads(rest.split(b"\r\n\r\n", 1)[1])
    assert status_line.split()[1] == b"413", received[:300]
    assert body["error"]["code"] == "request_too_large" and str(50 * 1024 * 1024 + 64 * 1024) in body["error"]["message"]


def loaded_model_status(http: httpx.Client) -> dict | None:
    data = http.get("/v1/admin/loaded-models").json()["data"]
    return next((m for m in data if m["id"] == LOADED_MODEL), None)


def rag_applications(schema: dict) -> dict:
    """The shared graph's applications RAG needs: the ingress (with its RAG deployment), the chat model, the embedder."""
    needed = {INGRESS_APP, serve_app_name(CHAT_MODEL), serve_app_name(EMBEDDER)}
    return {"applications": [app for app in schema["applications"] if app["name"] in needed]}


@pytest.mark.restarts_serve
def test_restart_keeps_documents_answers_and_loaded_models(rag_graph, tiny_models):
    """Deletes the ingress application (the ingress and its RAG deployment: the state lives on disk only) and the
    model loaded through the admin API (a run-time app: Serve's restart loses it), then deploys the ingress again
    beside the chat model and embedder RAG needs (Serve leaves those running: their config is unchanged; the graph's
    other models go), so it runs after every other test of the shared graph. The new ingress restores the loaded
    model from its state_dir."""
    from ray import serve
    from ray.serve.schema import ServeDeploySchema

    with http_client(rag_graph) as http:
        accepted = http.post("/v1/admin/load-model?wait=false",  # it loads while the document is read
                             json={"model_id": LOADED_MODEL, "model_path": str(tiny_models.gamma)})
        assert accepted.status_code == 202, accepted.text
        file_id = upload(http, "town-guide.pdf", town_guide_pdf()).json()["file_id"]
        documents_before = http.get("/v1/rag/documents").json()
        whole_before, streamed_before = answer_pair(http, file_id)
        wait_until(lambda: (loaded_model_status(http) or {}).get("status") == "running", GRAPH_START_S,
                   what=f"{LOADED_MODEL} running")
    serve.delete(INGRESS_APP)
    serve.delete(serve_app_name(LOADED_MODEL))
    assert not {INGRESS_APP, serve_app_name(LOADED_MODEL)} & set(serve.status().applications)
    restarted = rag_applications(rag_graph.schema)
    assert LOADED_MODEL not in {app["args"].get("model_id") for app in restarted["applications"]}
    deploy_graph(ServeDeploySchema.model_validate(restarted))
    with http_client(rag_graph) as http:
        wait_until(lambda: model_running(http, EMBEDDER, "embedding") and model_running(http, CHAT_MODEL),
                   GRAPH_START_S, what="the embedder and the chat model running")
        documents_after = http.get("/v1/rag/documents").json()
        whole_after, streamed_after = answer_pair(http, file_id)
        wait_until(lambda: model_running(http, LOADED_MODEL), GRAPH_START_S, what=f"{LOADED_MODEL} restored")
        restored = loaded_model_status(http)
        answer = http.post("/v1/chat/completions", json={
            "model": LOADED_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "temperature": 0, "ignore_eos": True,
        })
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4, answer.text
        assert http.delete(f"/v1/admin/unload-model/{LOADED_MODEL}").status_code == 200
    assert restored["model_path"] == str(tiny_models.gamma)
    assert documents_after == documents_before and file_id in {d["file_id"] for d in documents_after["data"]}
    assert whole_after["sources"] == whole_before["sources"]
    assert whole_after["choices"][0]["message"] == whole_before["choices"][0]["message"]
    assert streamed_content(streamed_after)[1] == streamed_content(streamed_before)[1]
