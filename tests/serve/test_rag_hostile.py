"""Hostile RAG uploads (issue 48) over the in-process stack with the real embedder: PDF bombs (time, memory, text,
page count, nesting), hostile file names, identical uploads at once, and failures midway. After every refusal
the document list and the store's folder are as before and /health still answers; limits are small, so a bomb is
cut in seconds, and nothing here asserts on a duration."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import subprocess
import sys
import zlib
from pathlib import Path
from typing import AsyncIterator

import pytest

pytest.importorskip("sentence_transformers", reason="the 'embeddings' extra is not installed")

from deployments.config import ModelConfig
from deployments.ingress_config import RagConfig
from deployments.rag import pdf_text  # noqa: E402
from deployments.rag import store as store_module  # noqa: E402
from deployments.rag.store import DocumentStore  # noqa: E402
from tests.serve.local_stack import LocalStack, local_stack  # noqa: E402
from tests.support.pdfs import build_pdf, make_pdf  # noqa: E402

FONT = b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"
PAGE = (b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources << /Font << /F1 3 0 R >> >> "
        b"/Contents 5 0 R >>")
# 100,000 text operators (2.3 MB, 6 KB compressed): ~2.5 s of pypdf per page here. Drawn by 2,000 pages: hours.
SLOW_PAGE = b"BT /F1 12 Tf (A) Tj ET\n" * 100_000
NOTE = b"The lighthouse keeper winds the clock every Sunday at dawn."


def shared_page_pdf(content: bytes, pages: int = 1, *, compress: bool = True) -> bytes:
    """`pages` pages that all draw the one content stream `content` (FlateDecode): a few KB on the wire."""
    stream = zlib.compress(content, 9) if compress else content
    kids = b" ".join([b"4 0 R"] * pages)
    flate = b" /Filter /FlateDecode" if compress else b""
    return build_pdf([
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [" + kids + b"] /Count %d >>" % pages,
        FONT, PAGE,
        b"<< /Length %d%s >>\nstream\n" % (len(stream), flate) + stream + b"\nendstream",
    ])


@contextlib.asynccontextmanager
async def rag_stack(tmp_path: Path, **rag_fields) -> AsyncIterator[LocalStack]:
    rag = RagConfig(storage_dir=str(tmp_path / "rag"), chunk_tokens=48, overlap_tokens=8, **rag_fields)
    async with local_stack([ModelConfig(model_path="default-embedding")], rag=rag) as stack:
        yield stack


async def upload(stack: LocalStack, filename: str, data: bytes, content_type: str = "application/pdf"):
    return await stack.http.post("/v1/rag/upload", files={"file": (filename, data, content_type)})


async def upload_raw_name(stack: LocalStack, raw_filename: bytes, data: bytes):
    """The multipart body written by hand: httpx percent-escapes control characters in a file name."""
    body = (b'--B0undary\r\nContent-Disposition: form-data; name="file"; filename="' + raw_filename
            + b'"\r\nContent-Type: text/plain\r\n\r\n' + data + b"\r\n--B0undary--\r\n")
    return await stack.http.post("/v1/rag/upload", content=body,
                                 headers={"content-type": "multipart/form-data; boundary=B0undary"})


async def snapshot(stack: LocalStack, tmp_path: Path) -> tuple[list, list[str]]:
    """What a failed upload must leave alone: the document list and every entry of the store's folder."""
    listed = (await stack.http.get("/v1/rag/documents")).json()["data"]
    return listed, sorted(path.name for path in (tmp_path / "rag").iterdir())


async def assert_unharmed(stack: LocalStack, tmp_path: Path, before: tuple[list, list[str]]) -> None:
    assert await snapshot(stack, tmp_path) == before
    assert (await stack.http.get("/health")).status_code == 200


def refusal(response) -> tuple[int, str, str | None, str]:
    error = response.json()["error"]
    return response.status_code, error["code"], error["param"], error["message"]


# ---- PDF bombs


def test_a_page_bomb_is_cut_at_the_read_deadline(tmp_path):
    """2,000 pages drawing one 6 KB stream: hours of pypdf in the replica before; now its child is killed."""
    bomb = shared_page_pdf(SLOW_PAGE, pages=2_000)
    assert len(bomb) < 30_000

    async def scenario():
        async with rag_stack(tmp_path, read_seconds=3) as stack:
            before = await snapshot(stack, tmp_path)
            refused = await upload(stack, "bomb.pdf", bomb)
            await assert_unharmed(stack, tmp_path, before)
            after = await upload(stack, "note.txt", NOTE, "text/plain")
            return refused, after

    refused, after = asyncio.run(scenario())
    status, code, param, message = refusal(refused)
    assert (status, code, param) == (413, "document_too_complex", "file")
    assert "longer to read than the limit of 3 s" in message
    assert after.status_code == 200 and after.json()["status"] == "indexed"


def test_a_memory_bomb_is_cut_at_the_memory_cap(tmp_path):
    """One page, one 60 MB string in 60 KB: pypdf peaked near 800 MB reading it in the replica, and returned 63 M
    characters of text to chunk and embed; now its child is over its cap."""
    bomb = shared_page_pdf(b"BT /F1 12 Tf (" + b"A" * (60 << 20) + b") Tj ET")
    assert len(bomb) < 100_000

    async def scenario():
        async with rag_stack(tmp_path, read_memory_bytes=200 << 20) as stack:
            before = await snapshot(stack, tmp_path)
            refused = await upload(stack, "bomb.pdf", bomb)
            await assert_unharmed(stack, tmp_path, before)
            after = await upload(stack, "note.pdf", make_pdf([[NOTE.decode()]]))
            return refused, after

    refused, after = asyncio.run(scenario())
    status, code, param, message = refusal(refused)
    assert (status, code, param) == (413, "document_too_complex", "file")
    assert "more memory to read than the limit of 200 MiB" in message
    assert after.status_code == 200 and after.json()["num_pages"] == 1  # a fresh child reads the next PDF


def test_text_over_the_limit_is_refused_whatever_the_type(tmp_path):
    """What chunking and embedding cost follows the text: a PDF or a text file with more than max_text_chars."""
    line = "The harbour master logs every ship that passes the breakwater."  # 62 characters
    many_pages = make_pdf([[line] * 40 for _ in range(10)])  # ~25,000 characters in 10 KB

    async def scenario():
        async with rag_stack(tmp_path, max_text_chars=20_000) as stack:
            before = await snapshot(stack, tmp_path)
            pdf = await upload(stack, "log.pdf", many_pages)
            text = await upload(stack, "log.md", (line + "\n").encode() * 400, "text/markdown")
            await assert_unharmed(stack, tmp_path, before)
            return pdf, text

    pdf, text = asyncio.run(scenario())
    assert refusal(pdf)[:3] == (413, "document_too_large", "file")
    assert "more text than the limit of 20000 characters (passed on page 8)" in refusal(pdf)[3]
    assert refusal(text)[:3] == (413, "document_too_large", "file")
    assert "holds 25200 characters of text; the limit is 20000" in refusal(text)[3]


def test_structural_bombs_are_refused_and_were_already(tmp_path):
    """Already safe before the child process (pypdf 7's own limits and Python's recursion limit): kept proven."""
    deep = b"[" * 100_000 + b"]" * 100_000
    cases = {
        "pages.pdf": shared_page_pdf(b"BT /F1 12 Tf (A) Tj ET", pages=100_000),  # 600 KB of page references
        "deep-content.pdf": shared_page_pdf(b"BT /F1 12 Tf (A) Tj ET " + deep + b" Tj", compress=False),
        "deep-catalog.pdf": build_pdf([b"<< /Type /Catalog /Pages 2 0 R /Deep " + deep + b" >>",
                                       b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
                                       b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] >>"]),
        "cycle.pdf": build_pdf([b"<< /Type /Catalog /Pages 2 0 R >>",
                                b"<< /Type /Pages /Kids [2 0 R 3 0 R] /Count 2 >>",
                                b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] >>"]),
    }

    async def scenario():
        async with rag_stack(tmp_path) as stack:
            before = await snapshot(stack, tmp_path)
            results = {name: await upload(stack, name, data) for name, data in cases.items()}
            await assert_unharmed(stack, tmp_path, before)
            return {name: refusal(response) for name, response in results.items()}

    results = asyncio.run(scenario())
    assert results["pages.pdf"][:3] == (413, "document_too_large", "file")
    assert "has 100000 pages; the limit is 2000" in results["pages.pdf"][3]
    for name in ("deep-content.pdf", "deep-catalog.pdf", "cycle.pdf"):
        assert results[name][:3] == (400, "malformed_document", "file"), name
        assert len(results[name][3]) < 500  # pypdf's message, cut: never the offending bytes at length


def test_lone_surrogates_in_a_pdf_are_replaced_not_a_500(tmp_path):
    """A ToUnicode map may name U+D800: no tokenizer or UTF-8 file takes it. It was a 500; now U+FFFD."""
    cmap = (b"/CIDInit /ProcSet findresource begin 12 dict begin begincmap /CMapName /X def "
            b"1 begincodespacerange <00> <FF> endcodespacerange 1 beginbfchar <41> <D800> endbfchar "
            b"endcmap CMapName currentdict /CMap defineresource pop end end")
    content = b"BT /F1 12 Tf 50 700 Td (A lighthouse keeper winds the clock) Tj ET"
    data = build_pdf([
        b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [4 0 R] /Count 1 >>",
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica /ToUnicode 6 0 R >>", PAGE,
        b"<< /Length %d >>\nstream\n" % len(content) + content + b"\nendstream",
        b"<< /Length %d >>\nstream\n" % len(cmap) + cmap + b"\nendstream",
    ])

    async def scenario():
        async with rag_stack(tmp_path) as stack:
            uploaded = await upload(stack, "map.pdf", data)
            assert uploaded.status_code == 200, uploaded.text
            retrieved = await stack.http.post("/v1/rag/query", json={
                "file_id": uploaded.json()["file_id"], "query": "who winds the clock?", "retrieval_only": True})
            return retrieved.json()["sources"]

    sources = asyncio.run(scenario())
    assert sources[0]["text"].startswith("\ufffd lighthouse keeper")
    assert DocumentStore(tmp_path / "rag").broken == []  # its metadata was written and reads back


def test_the_resident_size_watchdog_alone_stops_a_reader():
    """macOS does not enforce RLIMIT_AS: the child's own watchdog must stop it there. Here without the rlimit."""
    bomb = shared_page_pdf(b"BT /F1 12 Tf (" + b"A" * (60 << 20) + b") Tj ET")
    limits = {"max_pages": 10, "max_text_chars": 10**9, "memory_bytes": 200 << 20, "rlimit": False}
    done = subprocess.run([sys.executable, pdf_text.__file__, json.dumps(limits)], input=bomb, capture_output=True,
                          timeout=120, check=False)
    assert (done.returncode, done.stdout) == (pdf_text.MEMORY_EXIT, b"")


def test_pdfs_are_read_parallel_reads_at_a_time(tmp_path):
    """Each reader may take read_memory_bytes: with parallel_reads 1, two bombs at once never run two readers."""
    bombs = [shared_page_pdf(SLOW_PAGE + b"%% %d\n" % n, pages=2_000) for n in range(2)]  # two distinct files
    if not Path("/proc/self/stat").exists():
        pytest.skip("counts the readers through /proc")

    async def scenario():
        async with rag_stack(tmp_path, read_seconds=2, parallel_reads=1) as stack:
            uploads = asyncio.gather(*(upload(stack, f"bomb{n}.pdf", bomb) for n, bomb in enumerate(bombs)))
            readers = set()
            most = 0
            while not uploads.done():
                running = _readers_of(os.getpid())
                readers |= running
                most = max(most, len(running))
                await asyncio.sleep(0.05)
            return await uploads, readers, most

    responses, readers, most = asyncio.run(scenario())
    assert [refusal(response)[:2] for response in responses] == [(413, "document_too_complex")] * 2
    assert len(readers) == 2 and most == 1


def _readers_of(parent: int) -> set[int]:
    """The pdf_text.py children of `parent` running now."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == parent and b"pdf_text.py" in cmdline:
            found.add(int(entry.name))
    return found


# ---- file names


@pytest.mark.parametrize(
    ("raw_name", "stored"),
    [
        (b"../../etc/notes.txt", "notes.txt"),  # already so: the ingress keeps the last component
        (b"..\\..\\windows\\notes.txt", "notes.txt"),
        (b"C:\\Users\\ann\\notes.txt", "notes.txt"),
        (b"caf\xc3\xa9 \xe6\x96\x87\xe4\xbb\xb6.txt", "café 文件.txt"),  # any printable name is kept as sent
    ],
)
def test_paths_in_file_names_keep_their_last_component(tmp_path, raw_name, stored):
    async def scenario():
        async with rag_stack(tmp_path) as stack:
            response = await upload_raw_name(stack, raw_name, NOTE)
            listed, entries = await snapshot(stack, tmp_path)
            return response, listed, entries

    response, listed, entries = asyncio.run(scenario())
    assert response.status_code == 200, response.text
    assert [document["filename"] for document in listed] == [stored]
    assert entries == [hashlib.sha256(NOTE).hexdigest()]  # on disk the document is its hash, never its name


@pytest.mark.parametrize(
    ("raw_name", "fragment"),
    [
        (b"notes\x00.txt", "control character (U+0000 at position 5)"),
        (b"notes\n[2] forged.txt", "control character (U+000A at position 5)"),
        (b"notes\x1b[31m.txt", "control character (U+001B at position 5)"),
        (b"notes\xe2\x80\xaetxt.md", "control character (U+202E at position 5)"),  # shown as notesdm.txt
        (b"x" * 300 + b".txt", "file name of 304 characters; the limit is 255"),
        (b"..", "'..' is not a file name"),  # already a 400 (no suffix); now named as what it is
    ],
)
def test_control_characters_in_file_names_are_refused(tmp_path, raw_name, fragment):
    async def scenario():
        async with rag_stack(tmp_path) as stack:
            before = await snapshot(stack, tmp_path)
            response = await upload_raw_name(stack, raw_name, NOTE)
            await assert_unharmed(stack, tmp_path, before)
            return response

    status, code, param, message = refusal(asyncio.run(scenario()))
    assert (status, code, param) == (400, None, "file")
    assert fragment in message


# ---- identical uploads at once


def test_identical_bombs_at_once_are_read_once(tmp_path):
    """Four copies of one bomb at once share one read and its refusal (each waited for the last one's deadline)."""
    bomb = shared_page_pdf(SLOW_PAGE, pages=2_000)
    deadlines = _Records()
    logging.getLogger("ray.serve.orchard").addHandler(deadlines)

    async def scenario():
        async with rag_stack(tmp_path, read_seconds=3) as stack:
            before = await snapshot(stack, tmp_path)
            responses = await asyncio.gather(*(upload(stack, "bomb.pdf", bomb) for _ in range(4)))
            await assert_unharmed(stack, tmp_path, before)
            return responses

    try:
        responses = asyncio.run(scenario())
    finally:
        logging.getLogger("ray.serve.orchard").removeHandler(deadlines)
    assert [refusal(response)[:2] for response in responses] == [(413, "document_too_complex")] * 4
    assert sum("passed the deadline" in message for message in deadlines.messages) == 1


def test_identical_uploads_at_once_store_one_document(tmp_path):
    """Already so: the same bytes under three names, twice each, at once: one folder, one entry, one 'indexed'."""
    data = make_pdf([[NOTE.decode()]])

    async def scenario():
        async with rag_stack(tmp_path) as stack:
            responses = await asyncio.gather(*(upload(stack, f"copy{n % 3}.pdf", data) for n in range(6)))
            return [response.json() for response in responses], await snapshot(stack, tmp_path)

    bodies, (listed, entries) = asyncio.run(scenario())
    assert sorted(body["already_indexed"] for body in bodies) == [False] + [True] * 5
    assert {body["status"] for body in bodies} == {"indexed"}
    assert {body["file_id"] for body in bodies} == {hashlib.sha256(data).hexdigest()}
    assert len(listed) == 1 and entries == [hashlib.sha256(data).hexdigest()]
    assert len(DocumentStore(tmp_path / "rag").list_documents()) == 1


# ---- failures midway


def test_a_failure_after_publishing_leaves_no_document(tmp_path, monkeypatch):
    """The folder's rename is done, then the fsync of the store's folder fails (a disk fault, injected: none can be
    had here): the upload fails, so the published folder goes too; before, it stayed, unlisted, and the next start
    served a document whose upload had failed."""
    real_fsync = store_module._fsync_file

    def failing_fsync(path: Path) -> None:
        if path == tmp_path / "rag" and any(entry.name == hashlib.sha256(NOTE).hexdigest()
                                            for entry in path.iterdir()):
            raise OSError(5, "Input/output error")
        real_fsync(path)

    async def scenario():
        async with rag_stack(tmp_path) as stack:
            before = await snapshot(stack, tmp_path)
            monkeypatch.setattr(store_module, "_fsync_file", failing_fsync)
            # A 500; httpx's ASGI transport hands the client the app's exception itself.
            with pytest.raises(OSError, match="Input/output error"):
                await upload(stack, "note.txt", NOTE, "text/plain")
            monkeypatch.setattr(store_module, "_fsync_file", real_fsync)
            await assert_unharmed(stack, tmp_path, before)  # the folder a restart would have served is gone
            again = await upload(stack, "note.txt", NOTE, "text/plain")
            return again.json()["status"]

    assert asyncio.run(scenario()) == "indexed"  # and the same upload again works


def test_a_broken_file_under_the_id_is_replaced_without_leftovers(tmp_path):
    """A file (not a folder) left under a document's id is replaced by its upload; its .trash-* copy used to stay."""
    (tmp_path / "rag").mkdir()
    (tmp_path / "rag" / hashlib.sha256(NOTE).hexdigest()).write_text("not a document")

    async def scenario():
        async with rag_stack(tmp_path) as stack:
            uploaded = await upload(stack, "note.txt", NOTE, "text/plain")
            return uploaded, await snapshot(stack, tmp_path)

    uploaded, (listed, entries) = asyncio.run(scenario())
    assert uploaded.status_code == 200, uploaded.text
    assert entries == [hashlib.sha256(NOTE).hexdigest()] and len(listed) == 1
    assert DocumentStore(tmp_path / "rag").broken == []


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
