"""RagPipeline with the real all-MiniLM-L6-v2: retrieval quality, dedup, restart, concurrency, errors, the prompt."""

from __future__ import annotations

import asyncio
import hashlib

import pytest

from deployments.rag.chunking import ChunkParams
from deployments.rag.pipeline import (
    SYSTEM_PROMPT,
    ChatMessage,
    RagPipeline,
    build_prompt,
)
from deployments.rag.store import DocumentStore, SearchHit
from engine.errors import InvalidRequestError
from deployments.rag_calls import DocumentNotFoundError, MalformedDocumentError
from tests.support.town_guide import QUESTIONS, town_guide_pdf
from tests.support.pdfs import make_pdf

# Small chunks, so a page holds several and retrieval must pick the right one.
CHUNKS = ChunkParams(chunk_tokens=32, overlap_tokens=8)


def make_pipeline(minilm, root) -> RagPipeline:
    return RagPipeline(minilm, DocumentStore(root), chunk_params=CHUNKS)


def test_top3_retrieval_finds_the_page_for_most_questions(minilm, tmp_path):
    pipeline = make_pipeline(minilm, tmp_path)
    upload = asyncio.run(pipeline.upload("town-guide.pdf", town_guide_pdf()))
    assert upload.status == "indexed"
    assert (upload.document.filename, upload.document.num_pages) == ("town-guide.pdf", 10)
    assert upload.document.num_chunks > 10

    async def pages_found() -> list[bool]:
        found = []
        for question, page in QUESTIONS:
            sources = await pipeline.query([upload.document.file_id], question, top_k=3)
            assert len(sources) == 3
            assert [s.score for s in sources] == sorted((s.score for s in sources), reverse=True)
            found.append(page in [source.page for source in sources])
        return found

    found = asyncio.run(pages_found())
    missed = [question for (question, _), ok in zip(QUESTIONS, found, strict=True) if not ok]
    assert sum(found) >= 18, f"missed {missed}"


def test_reupload_is_detected_by_content(minilm, tmp_path):
    pipeline = make_pipeline(minilm, tmp_path)
    data = make_pdf([["Quartz clocks keep time with a vibrating crystal."]])
    first = asyncio.run(pipeline.upload("clocks.pdf", data))
    again = asyncio.run(pipeline.upload("copy-of-clocks.pdf", data))
    assert first.status == "indexed" and again.status == "already_indexed"
    assert again.document == first.document
    assert first.document.file_id == hashlib.sha256(data).hexdigest()
    assert [info.filename for info in pipeline.list_documents()] == ["clocks.pdf"]


def test_restart_keeps_documents_and_answers(minilm, tmp_path):
    pipeline = make_pipeline(minilm, tmp_path)
    guide = asyncio.run(pipeline.upload("town-guide.pdf", town_guide_pdf())).document
    notes = asyncio.run(pipeline.upload("notes.md", b"# Notes\n\nThe ferry to Korven leaves at noon.\n")).document
    question = "When does the ferry leave?"
    before = asyncio.run(pipeline.query([guide.file_id, notes.file_id], question, top_k=4))
    assert before[0].file_id == notes.file_id and before[0].page == 1
    restarted = make_pipeline(minilm, tmp_path)
    assert restarted.list_documents() == pipeline.list_documents()
    after = asyncio.run(restarted.query([guide.file_id, notes.file_id], question, top_k=4))
    assert [(s.file_id, s.chunk, s.text) for s in after] == [(s.file_id, s.chunk, s.text) for s in before]
    assert [s.score for s in after] == pytest.approx([s.score for s in before], abs=1e-5)


def test_parallel_uploads_and_queries_leave_consistent_indexes(minilm, tmp_path):
    pipeline = make_pipeline(minilm, tmp_path)
    documents = [make_pdf([[f"Document {n} says the secret colour number {n} is {colour}."]])
                 for n, colour in enumerate(["red", "green", "blue", "amber", "violet"])]

    async def scenario() -> list:
        uploads = await asyncio.gather(*(pipeline.upload(f"doc{n % 5}.pdf", documents[n % 5]) for n in range(10)))
        queries = await asyncio.gather(*(pipeline.query([u.document.file_id], "secret colour", 1) for u in uploads))
        return list(zip(uploads, queries, strict=True))

    results = asyncio.run(scenario())
    statuses = sorted(upload.status for upload, _ in results)
    assert statuses == ["already_indexed"] * 5 + ["indexed"] * 5
    assert pipeline._upload_locks == {}  # no lock left behind per uploaded hash
    for upload, sources in results:
        assert sources[0].file_id == upload.document.file_id
        assert sources[0].filename == upload.document.filename
    restarted = DocumentStore(tmp_path)
    assert len(restarted.list_documents()) == 5 and restarted.broken == []
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(hashlib.sha256(d).hexdigest() for d in documents)


def test_errors_are_typed_and_name_the_field(minilm, tmp_path):
    pipeline = make_pipeline(minilm, tmp_path)
    with pytest.raises(DocumentNotFoundError, match="no document with file_id 'missing'") as caught:
        asyncio.run(pipeline.query(["missing"], "anything", 3))
    assert caught.value.param == "file_id"
    with pytest.raises(InvalidRequestError, match="file_id must name at least one document"):
        asyncio.run(pipeline.query([], "anything", 3))
    with pytest.raises(MalformedDocumentError):
        asyncio.run(pipeline.upload("broken.pdf", b"%PDF-1.4 truncated"))
    info = asyncio.run(pipeline.upload("a.txt", b"Some text about owls.")).document
    with pytest.raises(InvalidRequestError, match="query must not be empty") as caught:
        asyncio.run(pipeline.query([info.file_id], "  ", 3))
    assert caught.value.param == "query"
    with pytest.raises(InvalidRequestError, match=r"top_k must be in \[1, 50\], got 51"):
        asyncio.run(pipeline.query([info.file_id], "owls", 51))
    assert asyncio.run(pipeline.delete(info.file_id)) == info
    with pytest.raises(DocumentNotFoundError):
        asyncio.run(pipeline.query([info.file_id], "owls", 3))
    assert list(tmp_path.iterdir()) == []


def test_build_prompt_numbers_the_sources():
    sources = [SearchHit("f1", "guide.pdf", 3, 7, "The library closes at eight.", 0.81),
               SearchHit("f2", "notes.md", 1, 0, "Bring a card.", 0.52)]
    assert build_prompt("When does the library close?", sources) == [
        ChatMessage("system", SYSTEM_PROMPT),
        ChatMessage("user", "Sources:\n\n[1] guide.pdf, page 3:\nThe library closes at eight.\n\n"
                            "[2] notes.md, page 1:\nBring a card.\n\nQuestion: When does the library close?"),
    ]
