"""Uploaded bytes -> text per page: PDF through pypdf, .txt / .md decoded as UTF-8 and split by size."""

from __future__ import annotations

import io
import logging
from dataclasses import dataclass
from pathlib import PurePath

from pypdf import PdfReader

from deployments.rag_calls import (
    DocumentTooLargeError,
    EmptyDocumentError,
    EncryptedDocumentError,
    ImageOnlyDocumentError,
    MalformedDocumentError,
    UnsupportedDocumentTypeError,
)

TEXT_SUFFIXES = (".txt", ".md")
PDF_SUFFIX = ".pdf"
SUPPORTED_SUFFIXES = (PDF_SUFFIX, *TEXT_SUFFIXES)

# pypdf logs every repaired defect of a sloppy PDF; one warning per upload is noise, not news.
logging.getLogger("pypdf").setLevel(logging.ERROR)


@dataclass(frozen=True)
class ExtractLimits:
    max_bytes: int = 50 * 1024 * 1024
    max_pages: int = 2_000
    # A text file is cut into "pages" of about this many characters, so sources can point somewhere.
    text_page_chars: int = 4_000


@dataclass(frozen=True)
class Page:
    number: int  # 1-based, as a reader counts them
    text: str


def extract_pages(filename: str, data: bytes, limits: ExtractLimits = ExtractLimits()) -> list[Page]:
    """The document's pages with their text (blank pages dropped); raises a typed error naming what is wrong."""
    suffix = PurePath(filename).suffix.lower()
    if suffix not in SUPPORTED_SUFFIXES:
        raise UnsupportedDocumentTypeError(
            f"{filename!r}: unsupported file type {suffix or '(none)'!r}; supported: {', '.join(SUPPORTED_SUFFIXES)}",
            param="file",
        )
    if not data:
        raise EmptyDocumentError(f"{filename!r} is empty (0 bytes)", param="file")
    if len(data) > limits.max_bytes:
        raise DocumentTooLargeError(
            f"{filename!r} is {len(data)} bytes; the limit is {limits.max_bytes} bytes", param="file"
        )
    if suffix == PDF_SUFFIX:
        pages = _pdf_pages(filename, data, limits)
    else:
        pages = _text_pages(filename, data, limits)
    return [page for page in pages if page.text.strip()]


def _pdf_pages(filename: str, data: bytes, limits: ExtractLimits) -> list[Page]:
    if not data.lstrip()[:5] == b"%PDF-":
        raise MalformedDocumentError(f"{filename!r} is not a PDF (no %PDF- header)", param="file")
    try:
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted and not reader.decrypt(""):
            raise EncryptedDocumentError(
                f"{filename!r} is encrypted with a password; upload an unencrypted copy", param="file"
            )
        page_count = len(reader.pages)
        if page_count > limits.max_pages:
            raise DocumentTooLargeError(
                f"{filename!r} has {page_count} pages; the limit is {limits.max_pages}", param="file"
            )
        pages = [Page(number, page.extract_text() or "") for number, page in enumerate(reader.pages, start=1)]
    except (EncryptedDocumentError, DocumentTooLargeError):
        raise
    # pypdf raises its own errors and assorted built-ins (KeyError, ValueError, ...) on broken input.
    except Exception as exc:
        raise MalformedDocumentError(f"{filename!r} is not a readable PDF: {exc}", param="file") from exc
    if page_count == 0:
        raise EmptyDocumentError(f"{filename!r} has no pages", param="file")
    if not any(page.text.strip() for page in pages):
        raise ImageOnlyDocumentError(
            f"{filename!r} has no extractable text on any of its {page_count} pages (scanned images?); OCR is not supported",
            param="file",
        )
    return pages


def _text_pages(filename: str, data: bytes, limits: ExtractLimits) -> list[Page]:
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise MalformedDocumentError(
            f"{filename!r} is not UTF-8 text (byte {exc.start} is invalid)", param="file"
        ) from exc
    if not text.strip():
        raise EmptyDocumentError(f"{filename!r} holds only whitespace", param="file")
    pages = [Page(number, piece) for number, piece in enumerate(split_by_size(text, limits.text_page_chars), start=1)]
    if len(pages) > limits.max_pages:
        raise DocumentTooLargeError(
            f"{filename!r} makes {len(pages)} pages of {limits.text_page_chars} characters; the limit is {limits.max_pages}",
            param="file",
        )
    return pages


def split_by_size(text: str, max_chars: int) -> list[str]:
    """Pieces of at most max_chars, each cut after the last line break or space before the limit (else at it)."""
    pieces: list[str] = []
    start = 0
    while len(text) - start > max_chars:
        window = text[start : start + max_chars]
        cut = max(window.rfind("\n"), window.rfind(" "))
        end = start + (cut + 1 if cut > 0 else max_chars)
        pieces.append(text[start:end])
        start = end
    pieces.append(text[start:])
    return pieces
