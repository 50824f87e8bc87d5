"""Uploaded bytes -> text per page: PDF through pypdf, .txt / .md decoded as UTF-8 and split by size.

A PDF is read by pdf_text.py in a child process (issue 48: a few KB of compressed content streams, shared by
2,000 pages, take hours and gigabytes to read): under a memory cap, a text cap and a deadline, past which that
child is killed and the upload refused with a 413 naming the limit. The replica only ever holds the texts.
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import unicodedata
from dataclasses import asdict, dataclass
from pathlib import Path, PurePath

import pypdf  # noqa: F401  the child's reader: imported here too so that a missing extra turns RAG off at start

from deployments.rag_calls import (
    DocumentTooComplexError,
    DocumentTooLargeError,
    EmptyDocumentError,
    EncryptedDocumentError,
    ImageOnlyDocumentError,
    MalformedDocumentError,
    UnsupportedDocumentTypeError,
)
from engine.errors import InvalidRequestError

from . import pdf_text

logger = logging.getLogger("ray.serve.orchard")

TEXT_SUFFIXES = (".txt", ".md")
PDF_SUFFIX = ".pdf"
SUPPORTED_SUFFIXES = (PDF_SUFFIX, *TEXT_SUFFIXES)
_READER = Path(pdf_text.__file__)
MAX_FILENAME_CHARS = 255
# Never a path (a document's folder is its sha256), but listed back and quoted in the answering prompt, where a
# line break or a bidi override could forge a source's header or disguise the name.
_BIDI_CONTROLS = frozenset("\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")
_REFUSED_CATEGORIES = frozenset({"Cc", "Cs", "Zl", "Zp"})
_SEPARATORS = frozenset("/\\")


@dataclass(frozen=True)
class ExtractLimits:
    max_bytes: int = 50 * 1024 * 1024
    max_pages: int = 2_000
    # A text file is cut into "pages" of about this many characters, so sources can point somewhere.
    text_page_chars: int = 4_000
    # A whole document's text (2,000 dense pages of 8,000): what chunking and embedding it will cost.
    max_text_chars: int = 16_000_000
    # One PDF's reading child: killed past either (2,000 plain pages of 4,000 characters: ~6 s on 2 cores).
    read_seconds: float = 60.0
    read_memory_bytes: int = 1 << 30
    # PDFs read at once (the pipeline's bound): at most this many times read_memory_bytes in readers.
    parallel_reads: int = 2


@dataclass(frozen=True)
class Page:
    number: int  # 1-based, as a reader counts them
    text: str


def check_filename(filename: str) -> None:
    """Raises InvalidRequestError (param 'file') for a name that is a path, too long, or holds control characters.
    The ingress has kept only the last component of a browser's path (C:\\docs\\a.pdf -> a.pdf) before this."""
    shown = repr(filename[:80])
    if not filename or filename in (".", ".."):
        raise InvalidRequestError(f"file name {shown} is not a file name", param="file")
    if len(filename) > MAX_FILENAME_CHARS:
        raise InvalidRequestError(
            f"file name of {len(filename)} characters; the limit is {MAX_FILENAME_CHARS}", param="file"
        )
    for position, char in enumerate(filename):
        if char in _SEPARATORS:
            kind = "a path separator"
        elif char in _BIDI_CONTROLS or unicodedata.category(char) in _REFUSED_CATEGORIES:
            kind = "a control character"
        else:
            continue
        raise InvalidRequestError(
            f"file name {shown} holds {kind} (U+{ord(char):04X} at position {position}); rename the file", param="file"
        )


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
    reply = _read_in_child(filename, data, limits)
    status = reply.get("status")
    if status == "encrypted":
        raise EncryptedDocumentError(
            f"{filename!r} is encrypted with a password; upload an unencrypted copy", param="file"
        )
    if status == "too_many_pages":
        raise DocumentTooLargeError(
            f"{filename!r} has {reply['pages']} pages; the limit is {limits.max_pages}", param="file"
        )
    if status == "too_much_text":
        raise DocumentTooLargeError(
            f"{filename!r} has more text than the limit of {limits.max_text_chars} characters (passed on page "
            f"{reply['page']})", param="file",
        )
    if status == "memory":
        raise _over_memory(filename, limits)
    if status == "malformed":
        raise MalformedDocumentError(f"{filename!r} is not a readable PDF: {reply['message']}", param="file")
    texts: list[str] = reply["pages"]
    if not texts:
        raise EmptyDocumentError(f"{filename!r} has no pages", param="file")
    if not any(text.strip() for text in texts):
        raise ImageOnlyDocumentError(
            f"{filename!r} has no extractable text on any of its {len(texts)} pages (scanned images?); OCR is not supported",
            param="file",
        )
    return [Page(number, text) for number, text in enumerate(texts, start=1)]


def _read_in_child(filename: str, data: bytes, limits: ExtractLimits) -> dict:
    """pdf_text.py's reply for these bytes; raises DocumentTooComplexError when its deadline or memory cap ends it."""
    child_limits = pdf_text.ReadLimits(limits.max_pages, limits.max_text_chars, limits.read_memory_bytes)
    command = [sys.executable, str(_READER), json.dumps(asdict(child_limits))]
    try:
        done = subprocess.run(command, input=data, capture_output=True, timeout=limits.read_seconds, check=False)
    except subprocess.TimeoutExpired as exc:  # run() has killed the child
        logger.warning("RAG: reading %r passed the deadline of %g s; its reader was killed", filename,
                       limits.read_seconds)
        raise DocumentTooComplexError(
            f"{filename!r} takes longer to read than the limit of {limits.read_seconds:g} s", param="file"
        ) from exc
    if done.returncode in (pdf_text.MEMORY_EXIT, -signal.SIGKILL):  # its watchdog, or the kernel's OOM killer
        raise _over_memory(filename, limits)
    if done.returncode < 0:
        logger.warning("RAG: the PDF reader died of signal %d on %r", -done.returncode, filename)
        raise MalformedDocumentError(
            f"{filename!r} crashed the PDF reader (signal {-done.returncode})", param="file"
        )
    try:
        reply = json.loads(done.stdout) if done.returncode == 0 else None
    except ValueError:
        reply = None
    if not isinstance(reply, dict):
        # Not the document's fault (pypdf missing, a bug): a 500, with the child's own words in the log.
        tail = done.stderr[-2000:].decode(errors="replace")
        raise RuntimeError(f"the PDF reader exited with status {done.returncode}: {tail}")
    return reply


def _over_memory(filename: str, limits: ExtractLimits) -> DocumentTooComplexError:
    size = limits.read_memory_bytes
    limit = f"{size / 2**30:g} GiB" if size >= 2**30 else f"{size / 2**20:g} MiB"
    logger.warning("RAG: reading %r needed more memory than the limit of %s; its reader stopped", filename, limit)
    return DocumentTooComplexError(
        f"{filename!r} needs more memory to read than the limit of {limit}", param="file"
    )


def _text_pages(filename: str, data: bytes, limits: ExtractLimits) -> list[Page]:
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise MalformedDocumentError(
            f"{filename!r} is not UTF-8 text (byte {exc.start} is invalid)", param="file"
        ) from exc
    if not text.strip():
        raise EmptyDocumentError(f"{filename!r} holds only whitespace", param="file")
    if len(text) > limits.max_text_chars:
        raise DocumentTooLargeError(
            f"{filename!r} holds {len(text)} characters of text; the limit is {limits.max_text_chars}", param="file"
        )
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
