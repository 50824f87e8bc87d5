"""RAG text extraction and chunking: no model needed."""

from __future__ import annotations

import pytest

from deployments.api.errors import wire_error
from deployments.rag.chunking import Chunk, ChunkParams, chunk_pages
from deployments.rag.extract import ExtractLimits, Page, extract_pages, split_by_size
from engine.errors import InvalidRequestError
from deployments.rag_calls import (
    DocumentNotFoundError,
    DocumentTooComplexError,
    DocumentTooLargeError,
    EmptyDocumentError,
    EncryptedDocumentError,
    ImageOnlyDocumentError,
    MalformedDocumentError,
    UnsupportedDocumentTypeError,
)
from tests.support.pdfs import DRAWING_ONLY, encrypt_pdf, make_pdf

TWO_PAGES = make_pdf([["The ferry leaves at noon.", "Tickets (cash only)."], ["Page two holds the map."]])


def test_pdf_text_per_page_with_numbers():
    pages = extract_pages("guide.pdf", TWO_PAGES)
    assert [page.number for page in pages] == [1, 2]
    assert pages[0].text.split("\n")[:2] == ["The ferry leaves at noon.", "Tickets (cash only)."]
    assert "Page two holds the map." in pages[1].text


def test_blank_pages_are_dropped_but_numbers_kept():
    data = make_pdf(streams=[DRAWING_ONLY, make_pdf_stream("Only page two has words.")])
    pages = extract_pages("mixed.pdf", data)
    assert [page.number for page in pages] == [2]


def make_pdf_stream(text: str) -> bytes:
    return f"BT /F1 11 Tf 50 700 Td ({text}) Tj ET".encode()


@pytest.mark.parametrize(
    ("filename", "data", "error", "fragment"),
    [
        ("a.pdf", b"", EmptyDocumentError, "is empty"),
        ("a.txt", b"", EmptyDocumentError, "is empty"),
        ("a.md", b" \n\t ", EmptyDocumentError, "only whitespace"),
        ("a.pdf", b"hello, not a pdf", MalformedDocumentError, "no %PDF- header"),
        ("a.pdf", b"%PDF-1.4\ngarbage", MalformedDocumentError, "not a readable PDF"),
        ("a.pdf", TWO_PAGES[:300], MalformedDocumentError, "not a readable PDF"),
        ("a.pdf", encrypt_pdf(TWO_PAGES), EncryptedDocumentError, "encrypted with a password"),
        ("a.pdf", make_pdf(streams=[DRAWING_ONLY, DRAWING_ONLY]), ImageOnlyDocumentError, "no extractable text"),
        ("a.docx", b"PK\x03\x04", UnsupportedDocumentTypeError, "unsupported file type '.docx'"),
        ("README", b"text", UnsupportedDocumentTypeError, "unsupported file type '(none)'"),
        ("a.txt", b"caf\xe9", MalformedDocumentError, "not UTF-8 text (byte 3 is invalid)"),
    ],
)
def test_unreadable_uploads_raise_named_errors(filename, data, error, fragment):
    with pytest.raises(error) as caught:
        extract_pages(filename, data)
    assert fragment in caught.value.message
    assert filename in caught.value.message
    assert caught.value.param == "file"
    assert isinstance(caught.value, InvalidRequestError)


def test_pdf_encrypted_for_owner_only_is_read():
    pages = extract_pages("a.pdf", encrypt_pdf(TWO_PAGES, user_password=""))
    assert [page.number for page in pages] == [1, 2]


def test_byte_and_page_limits():
    with pytest.raises(DocumentTooLargeError, match="is 11 bytes; the limit is 10 bytes"):
        extract_pages("a.txt", b"hello world", ExtractLimits(max_bytes=10))
    with pytest.raises(DocumentTooLargeError, match="has 2 pages; the limit is 1"):
        extract_pages("a.pdf", TWO_PAGES, ExtractLimits(max_pages=1))
    with pytest.raises(DocumentTooLargeError, match="makes 3 pages of 10 characters; the limit is 2"):
        extract_pages("a.txt", b"aaaa bbbb cccc dddd eeee", ExtractLimits(max_pages=2, text_page_chars=10))
    assert DocumentTooLargeError.code == "document_too_large"


def test_text_file_split_by_size_at_whitespace():
    text = "alpha beta\ngamma delta epsilon " * 3
    pages = extract_pages("notes.md", text.encode(), ExtractLimits(text_page_chars=25))
    assert "".join(page.text for page in pages) == text
    assert all(len(page.text) <= 25 for page in pages)
    assert [page.number for page in pages] == list(range(1, len(pages) + 1))
    assert split_by_size("x" * 25, 10) == ["x" * 10, "x" * 10, "x" * 5]
    assert split_by_size("short", 10) == ["short"]


def one_token_per_word(word: str) -> int:
    return 1


def test_chunks_respect_size_overlap_and_spans():
    page = Page(3, " ".join(f"w{i}" for i in range(25)))
    chunks = chunk_pages([page], one_token_per_word, ChunkParams(chunk_tokens=10, overlap_tokens=3))
    assert [chunk.text.split() for chunk in chunks] == [
        [f"w{i}" for i in range(10)],
        [f"w{i}" for i in range(7, 17)],
        [f"w{i}" for i in range(14, 24)],
        [f"w{i}" for i in range(21, 25)],
    ]
    assert [chunk.index for chunk in chunks] == [0, 1, 2, 3]
    assert all(chunk.page == 3 for chunk in chunks)
    assert all(page.text[chunk.char_start : chunk.char_end] == chunk.text for chunk in chunks)


def test_chunks_never_cross_pages_and_index_runs_over_the_document():
    pages = [Page(1, "a b c"), Page(2, "d e f g")]
    chunks = chunk_pages(pages, one_token_per_word, ChunkParams(chunk_tokens=3, overlap_tokens=0))
    assert chunks == [
        Chunk(page=1, index=0, text="a b c", char_start=0, char_end=5),
        Chunk(page=2, index=1, text="d e f", char_start=0, char_end=5),
        Chunk(page=2, index=2, text="g", char_start=6, char_end=7),
    ]


def test_token_counts_come_from_the_counter():
    # A word of n letters counts n tokens: "aaaa" alone fills a 4-token chunk, so no tail is repeated before it.
    pages = [Page(1, "aa b aaaa c c d")]
    chunks = chunk_pages(pages, len, ChunkParams(chunk_tokens=4, overlap_tokens=1))
    assert [chunk.text for chunk in chunks] == ["aa b", "aaaa", "c c d"]


def test_a_word_over_the_limit_is_its_own_chunk_and_progress_is_made():
    chunks = chunk_pages([Page(1, "x " + "y" * 50 + " z")], len, ChunkParams(chunk_tokens=5, overlap_tokens=4))
    assert [chunk.text for chunk in chunks] == ["x", "y" * 50, "z"]


def test_chunking_is_deterministic():
    pages = [Page(n, " ".join(f"word{n}-{i}" for i in range(300))) for n in range(1, 4)]
    params = ChunkParams(chunk_tokens=50, overlap_tokens=10)
    assert chunk_pages(pages, len, params) == chunk_pages(pages, len, params)


@pytest.mark.parametrize(("chunk_tokens", "overlap_tokens", "param"), [(0, 0, "chunk_tokens"), (10, 10, "overlap_tokens"),
                                                                      (10, -1, "overlap_tokens")])
def test_chunk_params_are_validated(chunk_tokens, overlap_tokens, param):
    with pytest.raises(InvalidRequestError) as caught:
        ChunkParams(chunk_tokens=chunk_tokens, overlap_tokens=overlap_tokens)
    assert caught.value.param == param


def test_document_errors_map_to_http_statuses():
    too_large = wire_error(DocumentTooLargeError("'a.pdf' is 300 bytes; the limit is 200 bytes", param="file"))
    assert (too_large.status, too_large.body["error"]["code"], too_large.body["error"]["param"]) == (
        413, "document_too_large", "file")
    too_complex = wire_error(DocumentTooComplexError("'a.pdf' takes longer to read than the limit of 60 s",
                                                     param="file"))
    assert (too_complex.status, too_complex.body["error"]["code"]) == (413, "document_too_complex")
    encrypted = wire_error(EncryptedDocumentError("'a.pdf' is encrypted", param="file"))
    assert (encrypted.status, encrypted.body["error"]["code"]) == (400, "encrypted_document")
    missing = wire_error(DocumentNotFoundError("no document with file_id 'x'", param="file_id"))
    assert (missing.status, missing.body["error"]["code"], missing.body["error"]["type"]) == (
        404, "document_not_found", "invalid_request_error")
