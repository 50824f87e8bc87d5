"""The RAG document store: FAISS search, persistence, crash leftovers, concurrency (vectors given, no model)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest

from deployments.rag.chunking import Chunk
from deployments.rag.store import (
    INDEX_FILE,
    META_FILE,
    DocumentInfo,
    DocumentStore,
    default_root,
)
from engine.errors import InvalidRequestError
from deployments.rag_calls import DocumentNotFoundError

DIM = 8


def unit_rows(seed: int, count: int) -> np.ndarray:
    rows = np.random.default_rng(seed).standard_normal((count, DIM)).astype(np.float32)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


def make_document(file_id: str, count: int = 5, seed: int = 0) -> tuple[DocumentInfo, list[Chunk], np.ndarray]:
    chunks = [Chunk(page=i // 2 + 1, index=i, text=f"{file_id} chunk {i}", char_start=0, char_end=10) for i in range(count)]
    info = DocumentInfo(file_id, f"{file_id}.pdf", num_pages=chunks[-1].page, num_chunks=count, created_at=1000.0 + seed)
    return info, chunks, unit_rows(seed, count)


def test_search_ranks_by_cosine_across_documents(tmp_path):
    store = DocumentStore(tmp_path)
    info_a, chunks_a, vectors_a = make_document("a", seed=1)
    info_b, chunks_b, vectors_b = make_document("b", seed=2)
    assert store.add(info_a, chunks_a, vectors_a) == (info_a, True)
    assert store.add(info_b, chunks_b, vectors_b) == (info_b, True)
    query = vectors_b[3]
    hits = store.search(["a", "b"], query, top_k=4)
    assert len(hits) == 4
    assert (hits[0].file_id, hits[0].chunk, hits[0].page, hits[0].text, hits[0].filename) == ("b", 3, 2, "b chunk 3", "b.pdf")
    assert hits[0].score == pytest.approx(1.0, abs=1e-5)
    expected = sorted(
        [("a", i, float(vectors_a[i] @ query)) for i in range(5)] + [("b", i, float(vectors_b[i] @ query)) for i in range(5)],
        key=lambda row: -row[2],
    )[:4]
    assert [(hit.file_id, hit.chunk) for hit in hits] == [(f, c) for f, c, _ in expected]
    assert [hit.score for hit in hits] == pytest.approx([s for _, _, s in expected], abs=1e-5)
    assert len(store.search(["a"], query, top_k=50)) == 5


def test_unknown_ids_and_bad_arguments(tmp_path):
    store = DocumentStore(tmp_path)
    store.add(*make_document("a"))
    with pytest.raises(DocumentNotFoundError, match="no document with file_id 'nope'") as caught:
        store.search(["a", "nope"], unit_rows(0, 1)[0], 3)
    assert caught.value.param == "file_id"
    with pytest.raises(DocumentNotFoundError):
        store.delete("nope")
    with pytest.raises(InvalidRequestError, match="top_k must be >= 1"):
        store.search(["a"], unit_rows(0, 1)[0], 0)
    with pytest.raises(InvalidRequestError, match="query vector has 4 dimensions"):
        store.search(["a"], np.ones(4, dtype=np.float32), 3)


def test_same_id_is_stored_once(tmp_path):
    store = DocumentStore(tmp_path)
    info, chunks, vectors = make_document("a")
    store.add(info, chunks, vectors)
    later = DocumentInfo("a", "renamed.pdf", 1, 5, 2000.0)
    assert store.add(later, chunks, vectors) == (info, False)
    assert store.list_documents() == [info]


def test_restart_sees_the_same_documents_and_results(tmp_path):
    store = DocumentStore(tmp_path)
    for seed, file_id in enumerate(["a", "b", "c"]):
        store.add(*make_document(file_id, count=7, seed=seed))
    store.delete("b")
    query = unit_rows(99, 1)[0]
    before = store.search(["a", "c"], query, 5)
    reopened = DocumentStore(tmp_path)
    assert reopened.list_documents() == store.list_documents()
    assert [info.file_id for info in reopened.list_documents()] == ["a", "c"]
    assert reopened.search(["a", "c"], query, 5) == before
    assert reopened.broken == []
    assert sorted(path.name for path in tmp_path.iterdir()) == ["a", "c"]


def test_crash_leftovers_are_cleaned_and_broken_documents_skipped(tmp_path):
    store = DocumentStore(tmp_path)
    store.add(*make_document("whole"))
    store.add(*make_document("nometa", seed=1))
    store.add(*make_document("badindex", seed=2))
    # A crash mid-write leaves only a temp folder; mid-delete only a trash folder.
    (tmp_path / ".tmp-half-0123").mkdir()
    (tmp_path / ".tmp-half-0123" / INDEX_FILE).write_bytes(b"partial")
    (tmp_path / ".trash-old-4567").mkdir()
    (tmp_path / "nometa" / META_FILE).unlink()
    (tmp_path / "badindex" / INDEX_FILE).write_bytes(b"truncated")
    reopened = DocumentStore(tmp_path)
    assert [info.file_id for info in reopened.list_documents()] == ["whole"]
    assert sorted(entry.path.name for entry in reopened.broken) == ["badindex", "nometa"]
    assert not (tmp_path / ".tmp-half-0123").exists() and not (tmp_path / ".trash-old-4567").exists()
    with pytest.raises(DocumentNotFoundError):
        reopened.search(["nometa"], unit_rows(0, 1)[0], 1)
    # Uploading the same content again replaces the broken leftover.
    info, chunks, vectors = make_document("nometa", seed=1)
    assert reopened.add(info, chunks, vectors) == (info, True)
    assert [entry.path.name for entry in reopened.broken] == ["badindex"]
    assert [entry.file_id for entry in DocumentStore(tmp_path).list_documents()] == ["whole", "nometa"]


def test_metadata_that_disagrees_with_the_index_is_skipped(tmp_path):
    store = DocumentStore(tmp_path)
    store.add(*make_document("a"))
    meta_path = tmp_path / "a" / META_FILE
    meta = json.loads(meta_path.read_text())
    meta["chunks"] = meta["chunks"][:-1]
    meta_path.write_text(json.dumps(meta))
    reopened = DocumentStore(tmp_path)
    assert reopened.list_documents() == []
    assert "index holds 5 vectors" in reopened.broken[0].reason


def test_a_failed_write_leaves_nothing(tmp_path):
    store = DocumentStore(tmp_path)
    info, chunks, vectors = make_document("a")
    with pytest.raises(ValueError, match="one vector row per chunk"):
        store.add(info, chunks, vectors[:3])
    (tmp_path / "a").mkdir()  # a non-document folder under the id: the write must still publish atomically
    (tmp_path / "a" / "junk").write_text("x")
    assert store.add(info, chunks, vectors) == (info, True)
    assert sorted(path.name for path in (tmp_path / "a").iterdir()) == [INDEX_FILE, META_FILE]
    assert [path.name for path in tmp_path.iterdir()] == ["a"]


def test_parallel_adds_deletes_and_searches_stay_consistent(tmp_path):
    store = DocumentStore(tmp_path)
    errors: list[BaseException] = []
    results: dict[str, list[bool]] = {}

    def worker(n: int) -> None:
        try:
            file_id = f"doc{n % 5}"  # two threads per id: one write wins, the other sees it
            info, chunks, vectors = make_document(file_id, seed=n % 5)
            _, created = store.add(info, chunks, vectors)
            results.setdefault(file_id, []).append(created)
            hits = store.search([file_id], vectors[0], 1)
            assert hits[0].chunk == 0 and hits[0].score == pytest.approx(1.0, abs=1e-5)
        except BaseException as exc:  # noqa: BLE001 - reported after join
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(10)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert {file_id: sorted(flags) for file_id, flags in results.items()} == {f"doc{i}": [False, True] for i in range(5)}
    deleters = [threading.Thread(target=lambda: _delete_quietly(store, "doc0")) for _ in range(4)]
    for thread in deleters:
        thread.start()
    for thread in deleters:
        thread.join()
    reopened = DocumentStore(tmp_path)
    assert [info.file_id for info in reopened.list_documents()] == [f"doc{i}" for i in range(1, 5)]
    assert reopened.broken == []
    assert sorted(path.name for path in tmp_path.iterdir()) == [f"doc{i}" for i in range(1, 5)]


def _delete_quietly(store: DocumentStore, file_id: str) -> None:
    try:
        store.delete(file_id)
    except DocumentNotFoundError:
        pass


def test_default_root_follows_orchard_home(monkeypatch, tmp_path):
    monkeypatch.setenv("ORCHARD_HOME", str(tmp_path))
    assert default_root() == tmp_path / "rag"
    monkeypatch.delenv("ORCHARD_HOME")
    assert default_root() == Path.home() / ".cache" / "orchard" / "rag"
