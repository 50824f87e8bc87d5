"""Bodega docs, the RAG pipeline (L848-869): upload a PDF, query it (whole and streamed), list and delete documents,
with the real all-MiniLM-L6-v2 embedder and raptor answering as the quick start loads it (L33-41)."""

from __future__ import annotations

import pytest

pytest.importorskip("sentence_transformers", reason="the 'embeddings' extra is not installed")

from deployments.config import ModelConfig
from deployments.ingress_config import RagConfig
from tests.conformance import docs_snippets  # noqa: E402
from tests.conformance.bodega_server import BASE_URL, bodega_server, curl_json, ensure_loaded  # noqa: E402
from tests.conformance.conftest import RAPTOR  # noqa: E402
from tests.conformance.docs_shapes import CHAT_COMPLETION, RAG_UPLOAD, assert_documented_shape  # noqa: E402
from tests.support.pdfs import make_pdf  # noqa: E402

RAPTOR_QUICK_START = {"model_path": RAPTOR, "model_id": "bodega-raptor-8b", "model_type": "lm",
                      "context_length": 32768, "prompt_cache_size": 10}  # L35-41
DOCUMENT = make_pdf([
    ["Orchard field survey, spring report.", "Apple trees on the north slope flowered two weeks early."],
    ["Pollinator counts rose by a third after the hedgerows were replanted."],
    ["Conclusion: replanting hedgerows is the main reason the harvest improved."],
])


@pytest.fixture(scope="module")
def requests(lm_folder, tmp_path_factory):
    rag = RagConfig(storage_dir=str(tmp_path_factory.mktemp("rag")), chunk_tokens=48, overlap_tokens=8)
    with bodega_server({RAPTOR: lm_folder}, tmp_path_factory.mktemp("hf-cache"),
                       configs=[ModelConfig(model_path="default-embedding")], rag=rag) as server:
        ensure_loaded(server.requests, RAPTOR_QUICK_START)
        yield server.requests


@pytest.fixture
def document_pdf(tmp_path):
    path = tmp_path / "document.pdf"  # curl -F "file=@/path/to/your/document.pdf"
    path.write_bytes(DOCUMENT)
    return path


def upload(requests, path):
    """L849-850: curl -X POST .../v1/rag/upload -F "file=@<path>" (curl sends a .pdf as application/pdf)."""
    with open(path, "rb") as file:
        return requests.post(f"{BASE_URL}/v1/rag/upload", files={"file": (path.name, file, "application/pdf")})


def test_E53_upload_a_pdf_then_the_same_bytes_again(requests, document_pdf):
    """L848-857: the answer has file_id, filename, num_chunks and status "indexed"; uploading the same bytes again
    answers "indexed" too (already_indexed: true), with the same file_id."""
    first = upload(requests, document_pdf)
    assert first.status_code == 200, first.text
    assert_documented_shape(first.json(), RAG_UPLOAD)
    assert (first.json()["filename"], first.json()["status"]) == ("document.pdf", "indexed")
    assert first.json()["num_chunks"] >= 1
    again = upload(requests, document_pdf)
    assert again.status_code == 200, again.text
    assert_documented_shape(again.json(), RAG_UPLOAD)
    assert (again.json()["status"], again.json()["already_indexed"]) == ("indexed", True)
    assert again.json()["file_id"] == first.json()["file_id"]


def query_body(file_id: str) -> str:
    """L859-865, with the file_id of this server's upload in place of the docs' "rag-c6cd8f10"."""
    return """{
"file_id": "rag-c6cd8f10",
"query": "What is the main conclusion of this document?",
"model": "bodega-raptor-8b",
"top_k": 5
}""".replace("rag-c6cd8f10", file_id)


def test_E54_query_answers_a_chat_completion(requests, document_pdf):
    """L858-866: the question is answered by the chat model over the retrieved chunks."""
    file_id = upload(requests, document_pdf).json()["file_id"]
    response = curl_json(requests, "POST", "/v1/rag/query", query_body(file_id))
    assert response.status_code == 200, response.text
    assert_documented_shape(response.json(), CHAT_COMPLETION)
    assert response.json()["choices"][0]["message"]["content"] == "OK"


def test_E55_query_streamed_like_chat_completions(requests, document_pdf):
    """L866: "stream": true gives the answer as SSE "identical to the standard /v1/chat/completions endpoint": the
    docs' chat stream loop (L185-196) reads it."""
    file_id = upload(requests, document_pdf).json()["file_id"]
    body = query_body(file_id).replace('"top_k": 5', '"top_k": 5,\n"stream": true')
    response = curl_json(requests, "POST", "/v1/rag/query", body)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    ran = docs_snippets.run(docs_snippets.print_stream, response)
    assert ran.printed == "OK"


def test_E56_list_documents(requests, document_pdf):
    """L867-868: GET /v1/rag/documents lists the uploaded document (the docs show no answer: a list of documents)."""
    file_id = upload(requests, document_pdf).json()["file_id"]
    response = curl_json(requests, "GET", "/v1/rag/documents")
    assert response.status_code == 200, response.text
    listed = {document["file_id"]: document for document in response.json()["data"]}
    assert listed[file_id]["filename"] == "document.pdf"


def test_E57_delete_a_document(requests, document_pdf):
    """L868-869: DELETE /v1/rag/documents/{file_id} removes it from the list; the docs' literal id "rag-c6cd8f10" (never
    issued by this server) is a typed 404."""
    file_id = upload(requests, document_pdf).json()["file_id"]
    response = curl_json(requests, "DELETE", f"/v1/rag/documents/{file_id}")
    assert response.status_code == 200, response.text
    assert file_id not in {d["file_id"] for d in requests.get(f"{BASE_URL}/v1/rag/documents").json()["data"]}
    missing = curl_json(requests, "DELETE", "/v1/rag/documents/rag-c6cd8f10")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "document_not_found", missing.text
