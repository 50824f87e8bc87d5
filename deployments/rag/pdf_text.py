"""The PDF reader's child process: a PDF's bytes on stdin -> one JSON reply on stdout (issue 48, RAG uploads).

extract.py runs this file by its path with sys.executable: it imports only pypdf and the standard library (never
`deployments` or `engine`, whose imports load MLX), so it starts in a fraction of a second. It caps its own memory
(RLIMIT_AS where the kernel enforces it, Linux; and a resident-size watchdog, for macOS, which does not) and its text;
the parent holds the deadline and kills it past that. A hostile PDF then costs this child alone.

Replies: {"status": "ok", "pages": [text, ...]} (one per page, blank ones included), "encrypted",
"too_many_pages" (with "pages": the count), "too_much_text" (with "page": where the limit was passed),
"malformed" (with pypdf's "message"), "memory".
"""

from __future__ import annotations

import sys

# Run by path, Python puts this file's folder first on sys.path: nothing in it may shadow a module imported below.
if __name__ == "__main__" and sys.path and sys.path[0]:
    del sys.path[0]

import io  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from dataclasses import dataclass  # noqa: E402

# The exit status of a child stopped by its RSS watchdog (over the memory limit with no MemoryError raised).
MEMORY_EXIT = 86
_WATCH_INTERVAL_S = 0.05
_MESSAGE_CHARS = 300  # pypdf's messages can quote the offending bytes at length


@dataclass(frozen=True)
class ReadLimits:
    """argv of the child, as JSON: what the parent's ExtractLimits allow."""

    max_pages: int
    max_text_chars: int
    memory_bytes: int  # RLIMIT_AS and the RSS watchdog; 0: neither
    rlimit: bool = True  # False leaves the watchdog alone to enforce memory_bytes (its own test)


def main() -> int:
    limits = ReadLimits(**json.loads(sys.argv[1]))
    _cap_memory(limits)
    data = sys.stdin.buffer.read()
    # pypdf logs every repaired defect and warns on odd input: noise on a pipe nobody reads.
    logging.getLogger("pypdf").setLevel(logging.CRITICAL)
    warnings.simplefilter("ignore")
    try:
        reply = json.dumps(read(data, limits), ensure_ascii=False).encode("utf-8")  # texts are clean of surrogates
    except MemoryError:  # the texts' JSON too: the small reply below still fits once they are gone
        reply = json.dumps({"status": "memory"}).encode("utf-8")
    sys.stdout.buffer.write(reply)
    sys.stdout.buffer.flush()
    return 0


def read(data: bytes, limits: ReadLimits) -> dict:
    from pypdf import PdfReader  # after the caps: its own imports and parsing count against them

    try:
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted and not reader.decrypt(""):
            return {"status": "encrypted"}
        page_count = len(reader.pages)
        if page_count > limits.max_pages:
            return {"status": "too_many_pages", "pages": page_count}
        texts: list[str] = []
        chars = 0
        for number, page in enumerate(reader.pages, start=1):
            text = _clean(page.extract_text() or "")
            chars += len(text)
            if chars > limits.max_text_chars:
                return {"status": "too_much_text", "page": number}
            texts.append(text)
    except MemoryError:
        raise
    except RecursionError:
        return {"status": "malformed", "message": "objects nested too deeply"}
    # pypdf raises its own errors and assorted built-ins (KeyError, ValueError, ...) on broken input.
    except Exception as exc:
        if _caused_by_memory(exc):
            raise MemoryError from exc
        message = (str(exc).splitlines() or [type(exc).__name__])[0][:_MESSAGE_CHARS]
        return {"status": "malformed", "message": message}
    return {"status": "ok", "pages": texts}


def _caused_by_memory(exc: BaseException | None) -> bool:
    # pypdf wraps some failures in its own errors: a MemoryError underneath is still the memory cap.
    seen = 0
    while exc is not None and seen < 32:
        if isinstance(exc, MemoryError):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def _clean(text: str) -> str:
    # A ToUnicode map can name lone surrogates (U+D800...): no UTF-8 encoder or tokenizer takes them.
    if not any("\ud800" <= c <= "\udfff" for c in text):
        return text
    return "".join("\ufffd" if "\ud800" <= c <= "\udfff" else c for c in text)


def _cap_memory(limits: ReadLimits) -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a crash over the cap leaves no core file behind
    if limits.memory_bytes <= 0:
        return
    if limits.rlimit:
        try:
            resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
        except (ValueError, OSError):
            pass  # refused on some kernels: the watchdog still holds
    threading.Thread(target=_watch_rss, args=(limits.memory_bytes,), daemon=True).start()


def _watch_rss(memory_bytes: int) -> None:
    # A peak inherited from the parent at exec (macOS's only measure) must not count: only growth past it does.
    floor = max(memory_bytes, _rss_bytes())
    while True:
        if _rss_bytes() > floor:
            os._exit(MEMORY_EXIT)
        time.sleep(_WATCH_INTERVAL_S)


def _rss_bytes() -> int:
    """Resident size now (Linux /proc); elsewhere the peak, all getrusage offers (as engine/process_memory.py)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


if __name__ == "__main__":
    sys.exit(main())
