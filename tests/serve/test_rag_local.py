"""/v1/rag/* over the in-process stack: the real all-MiniLM-L6-v2 embedder and a tiny chat model, the RAG service
reaching both through the registry as the RAG deployment does through Serve handles. Route shapes, answers
streamed == not streamed, sources, retrieval only, listing and deleting, and every refusal with its status."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
from typing import AsyncIterator

import pytest

pytest.importorskip("sentence_transformers", reason="the 'embeddings' extra is not installed")

from deployments.config import ModelConfig
from deployments.ingress_config import RagConfig
from deployments.rag.pipeline import SYSTEM_PROMPT  # noqa: E402
from tests.support.town_guide import town_guide_pdf  # noqa: E402
from tests.serve.local_stack import LocalStack, local_stack  # noqa: E402
from tests.support.pdfs import encrypt_pdf, make_pdf  # noqa: E402

CHAT_MODEL = "tiny/alpha"
UPLOAD_LIMIT = 200_000


@contextlib.asynccontextmanager
async def rag_stack(tiny_models, tmp_path, **rag_fields) -> AsyncIterator[LocalStack]:
    configs = [ModelConfig(model_path="default-embedding"),
               ModelConfig(model_id=CHAT_MODEL, model_path=str(tiny_models.alpha), context_length=2048)]
    rag = RagConfig(storage_dir=str(tmp_path / "rag"), max_upload_bytes=UPLOAD_LIMIT, chunk_tokens=48,
                    overlap_tokens=8, **rag_fields)
    async with local_stack(configs, rag=rag) as stack:
        yield stack


async def upload(stack: LocalStack, filename: str, data: bytes, content_type: str = "application/pdf"):
    return await stack.http.post("/v1/rag/upload", files={"file": (filename, data, content_type)})


def sse_payloads(text: str) -> list[dict]:
    events = [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_upload_query_stream_and_documents(tiny_models, tmp_path):
    guide = town_guide_pdf()

    async def scenario():
        async with rag_stack(tiny_models, tmp_path) as stack:
            first = await upload(stack, "town-guide.pdf", guide)
            assert first.status_code == 200, first.text
            document = first.json()
            assert document["file_id"] == hashlib.sha256(guide).hexdigest()
            assert (document["filename"], document["num_pages"], document["status"]) == ("town-guide.pdf", 10, "indexed")
            assert document["num_chunks"] >= 10
            again = await upload(stack, "renamed.pdf", guide)
            assert (again.json()["status"], again.json()["already_indexed"]) == ("indexed", True)
            assert again.json()["file_id"] == document["file_id"]

            query = {"file_id": document["file_id"], "query": "Which platform does the night train leave from?",
                     "top_k": 3}
            retrieved = await stack.http.post("/v1/rag/query", json={**query, "retrieval_only": True})
            assert retrieved.status_code == 200, retrieved.text
            sources = retrieved.json()["sources"]
            assert retrieved.json()["object"] == "rag.retrieval" and len(sources) == 3
            assert sources[0]["page"] == 7 and "platform nine" in sources[0]["text"]
            assert sources[0]["score"] >= sources[1]["score"] >= sources[2]["score"]
            assert set(sources[0]) == {"file_id", "filename", "page", "chunk", "score", "text"}

            answer_fields = {**query, "model": CHAT_MODEL, "temperature": 0, "max_tokens": 16}
            whole = await stack.http.post("/v1/rag/query", json=answer_fields)
            assert whole.status_code == 200, whole.text
            streamed = await stack.http.post("/v1/rag/query", json={**answer_fields, "stream": True,
                                                                     "stream_options": {"include_usage": True}})
            assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
            # Both answers counted under api="rag" (the retrieval-only query reached no model).
            metrics = (await stack.http.get("/metrics")).text
            assert f'orchard:requests_total{{api="rag",model_name="{CHAT_MODEL}",status="finished"}} 2.0' in metrics
            listed = await stack.http.get("/v1/rag/documents")
            deleted = await stack.http.delete(f"/v1/rag/documents/{document['file_id']}")
            gone = await stack.http.post("/v1/rag/query", json={**query, "retrieval_only": True})
            listed_after = await stack.http.get("/v1/rag/documents")
            return sources, whole.json(), streamed.text, listed.json(), deleted, gone, listed_after.json()

    sources, whole, streamed, listed, deleted, gone, listed_after = asyncio.run(scenario())
    assert whole["object"] == "chat.completion" and whole["model"] == CHAT_MODEL
    assert whole["sources"] == sources  # the same retrieval, in the answer
    assert whole["usage"]["prompt_tokens"] > 100  # the prompt holds the sources, not just the question
    events = sse_payloads(streamed)
    assert events[0]["object"] == "chat.completion.chunk" and events[0]["sources"] == sources
    assert all("sources" not in event for event in events[1:])
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    usage = events[-1]["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (whole["usage"]["prompt_tokens"], whole["usage"]["completion_tokens"])
    assert usage["prompt_tokens_details"]["cached_tokens"] > 100  # the same prompt again: the prefix cache's
    assert [d["file_id"] for d in listed["data"]] == [sources[0]["file_id"]]
    assert listed["data"][0]["object"] == "rag.document" and listed["data"][0]["num_pages"] == 10
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "document_not_found"
    assert listed_after == {"object": "list", "data": []}


def test_the_answering_prompt_holds_the_sources(tiny_models, tmp_path):
    """The model is asked over the numbered sources: its prompt (counted by the model) is the system rules, the
    sources and the question, so it is longer by exactly the sources' and rules' tokens than the bare question."""

    async def scenario():
        async with rag_stack(tiny_models, tmp_path) as stack:
            file_id = (await upload(stack, "guide.txt", b"The ferry to Korven leaves at noon. " * 3, "text/plain")).json()["file_id"]
            body = {"file_id": file_id, "query": "When does the ferry leave?", "model": CHAT_MODEL, "max_tokens": 1}
            with_sources = (await stack.http.post("/v1/rag/query", json=body)).json()
            bare = await stack.http.post("/v1/chat/completions", json={
                "model": CHAT_MODEL, "max_tokens": 1, "messages": [
                    {"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": "Sources:\n\n[1] guide.txt, page 1:\n"
                     + with_sources["sources"][0]["text"] + "\n\nQuestion: When does the ferry leave?"}]})
            return with_sources, bare.json()

    with_sources, bare = asyncio.run(scenario())
    assert len(with_sources["sources"]) == 1
    assert with_sources["usage"]["prompt_tokens"] == bare["usage"]["prompt_tokens"]


@pytest.mark.parametrize(
    ("filename", "data", "status", "code"),
    [
        ("empty.pdf", b"", 400, "empty_document"),
        ("broken.pdf", b"%PDF-1.4 this is not a pdf", 400, "malformed_document"),
        ("locked.pdf", "encrypted", 400, "encrypted_document"),
        ("picture.pdf", "drawing", 400, "image_only_document"),
        ("notes.docx", b"PK\x03\x04", 400, "unsupported_document_type"),
        ("big.txt", b"x" * (UPLOAD_LIMIT + 1), 413, "document_too_large"),
        ("huge.txt", b"x" * (UPLOAD_LIMIT + 100_000), 413, "request_too_large"),
    ],
)
def test_bad_uploads_are_refused_clearly(tiny_models, tmp_path, filename, data, status, code):
    if data == "encrypted":
        data = encrypt_pdf(make_pdf([["secret page"]]))
    elif data == "drawing":
        from tests.support.pdfs import DRAWING_ONLY

        data = make_pdf(streams=[DRAWING_ONLY])

    async def scenario():
        async with rag_stack(tiny_models, tmp_path) as stack:
            response = await upload(stack, filename, data)
            listed = await stack.http.get("/v1/rag/documents")
            return response, listed.json()

    response, listed = asyncio.run(scenario())
    assert response.status_code == status, response.text
    assert response.json()["error"]["code"] == code
    assert listed["data"] == []


def test_bad_requests_name_the_field(tiny_models, tmp_path):
    async def scenario():
        async with rag_stack(tiny_models, tmp_path) as stack:
            file_id = (await upload(stack, "a.md", b"# Notes\nThe key is under the mat.", "text/markdown")).json()["file_id"]
            results = {
                "not multipart": await stack.http.post("/v1/rag/upload", json={"file": "x"}),
                "no file field": await stack.http.post("/v1/rag/upload", files={"document": ("a.txt", b"hi", "text/plain")}),
                "unknown file_id": await stack.http.post("/v1/rag/query", json={
                    "file_id": "0" * 64, "query": "key?", "retrieval_only": True}),
                "no documents": await stack.http.post("/v1/rag/query", json={"query": "key?", "retrieval_only": True}),
                "no model": await stack.http.post("/v1/rag/query", json={"file_id": file_id, "query": "key?"}),
                "unknown model": await stack.http.post("/v1/rag/query", json={
                    "file_id": file_id, "query": "key?", "model": "nope"}),
                "embedder as model": await stack.http.post("/v1/rag/query", json={
                    "file_id": file_id, "query": "key?", "model": "all-MiniLM-L6-v2"}),
                "top_k too large": await stack.http.post("/v1/rag/query", json={
                    "file_id": file_id, "query": "key?", "retrieval_only": True, "top_k": 51}),
                "bad max_tokens": await stack.http.post("/v1/rag/query", json={
                    "file_id": file_id, "query": "key?", "model": CHAT_MODEL, "max_tokens": 0}),
                "delete unknown": await stack.http.delete("/v1/rag/documents/" + "f" * 64),
                "delete a path": await stack.http.delete("/v1/rag/documents/..%2F..%2Fetc"),
            }
            return {name: (r.status_code, r.json()["error"]) for name, r in results.items()}

    results = asyncio.run(scenario())
    assert results["not multipart"][0] == 400 and results["not multipart"][1]["param"] == "file"
    assert results["no file field"][0] == 400 and "'file'" in results["no file field"][1]["message"]
    assert results["unknown file_id"][0] == 404 and results["unknown file_id"][1]["code"] == "document_not_found"
    assert results["no documents"][0] == 400 and "file_id" in results["no documents"][1]["message"]
    assert results["no model"][0] == 400 and "'model' is required" in results["no model"][1]["message"]
    assert results["unknown model"][0] == 404 and results["unknown model"][1]["code"] == "model_not_found"
    assert results["embedder as model"][0] == 400 and "embedding model" in results["embedder as model"][1]["message"]
    assert results["top_k too large"][0] == 400 and results["top_k too large"][1]["param"] == "top_k"
    assert results["bad max_tokens"][0] == 400 and results["bad max_tokens"][1]["param"] == "max_tokens"
    assert results["delete unknown"][0] == 404 and results["delete a path"][0] == 404


def test_rag_without_its_embedder_is_unavailable(tiny_models, tmp_path):
    async def scenario():
        rag = RagConfig(storage_dir=str(tmp_path / "rag"))
        chat = ModelConfig(model_id=CHAT_MODEL, model_path=str(tiny_models.alpha))
        async with local_stack([chat], rag=rag) as stack:
            return await upload(stack, "a.txt", b"some text", "text/plain")

    response = asyncio.run(scenario())
    assert response.status_code == 503 and response.json()["error"]["code"] == "rag_unavailable"
    assert "all-MiniLM-L6-v2" in response.json()["error"]["message"]
