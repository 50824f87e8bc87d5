"""The Files API's store: what `POST /v1/files` uploads for the Batch API (purpose "batch"), each file's bytes and
its FileObject under the ingress's state dir (`files/`), kept across restarts.

Strict where the Batch API depends on it: a batch file is UTF-8 JSONL, one JSON object per line, checked at upload
(the line that is not is named); ids are ours (`file-` + 24 hex digits) and the only names that reach the disk, so
a client's filename is metadata and an id from a request cannot name a path.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from deployments.api.errors import StoredFileNotFoundError
from deployments.ingress_config import DEFAULT_MAX_FILE_BYTES
from engine.errors import InvalidRequestError

FILE_PURPOSES = ("batch",)
FILE_ID = re.compile(r"file-[0-9a-f]{24}")
MAX_FILENAME_CHARS = 255


@dataclass
class StoredFile:
    """OpenAI's FileObject, as kept (files/<id>.json beside files/<id>.data)."""

    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    created_ns: int = 0  # orders files uploaded within one second (not on the wire)

    def to_wire(self) -> dict[str, Any]:
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "expires_at": None, "filename": self.filename, "purpose": self.purpose, "status": "processed",
                "status_details": None}


class FileStore:
    def __init__(self, root: Path, max_bytes: int = DEFAULT_MAX_FILE_BYTES) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self._lock = threading.Lock()  # creates and deletes come from the ingress's threads

    def create(self, purpose: str, filename: str, data: bytes) -> StoredFile:
        if purpose not in FILE_PURPOSES:
            raise InvalidRequestError(f"Orchard keeps files for the Batch API: purpose must be one of "
                                      f"{list(FILE_PURPOSES)}, not {purpose!r}", param="purpose")
        if len(data) > self.max_bytes:
            raise InvalidRequestError(f"The file holds {len(data)} bytes; at most {self.max_bytes} are accepted",
                                      param="file")
        check_jsonl(data)
        name = os.path.basename(filename.replace("\\", "/"))[:MAX_FILENAME_CHARS] or "upload.jsonl"
        return self._add(len(data), name, purpose, lambda target: write_atomically(target, data))

    def get(self, file_id: str) -> StoredFile:
        path = self._path(file_id, "json")
        try:
            return StoredFile(**json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError, TypeError):
            raise StoredFileNotFoundError(f"No such file: {file_id!r}", param="file_id") from None

    def keep(self, path: Path, filename: str, purpose: str) -> StoredFile:
        """A file the server wrote (a batch's output or errors) taken into the store as it is (moved, not copied)."""
        return self._add(path.stat().st_size, filename, purpose, lambda target: os.replace(path, target))

    def _add(self, size: int, filename: str, purpose: str, put_data: Callable[[Path], None]) -> StoredFile:
        """A new file: `put_data` puts its bytes at the path given, then its FileObject is written beside them."""
        now = time.time_ns()
        stored = StoredFile(f"file-{secrets.token_hex(12)}", size, now // 10**9, filename, purpose, now)
        with self._lock:
            self.root.mkdir(parents=True, exist_ok=True)
            put_data(self.root / f"{stored.id}.data")
            write_atomically(self.root / f"{stored.id}.json", json.dumps(asdict(stored)).encode())
        return stored

    def content_path(self, file_id: str) -> Path:
        self.get(file_id)
        return self._path(file_id, "data")

    def listing(self, purpose: str | None, order: str) -> list[StoredFile]:
        """The files (of `purpose`, if given) by creation time, `order` asc or desc."""
        ids = [p.stem for p in self.root.glob("file-*.json")] if self.root.is_dir() else []
        files = [f for f in (self._maybe(i) for i in ids) if f is not None and purpose in (None, f.purpose)]
        return sorted(files, key=lambda f: (f.created_ns, f.id), reverse=order == "desc")

    def delete(self, file_id: str) -> None:
        self.get(file_id)
        with self._lock:
            for suffix in ("data", "json"):
                self._path(file_id, suffix).unlink(missing_ok=True)

    def _maybe(self, file_id: str) -> StoredFile | None:
        try:
            return self.get(file_id)
        except StoredFileNotFoundError:  # deleted meanwhile, or a stray file
            return None

    def _path(self, file_id: str, suffix: str) -> Path:
        if not FILE_ID.fullmatch(file_id):
            raise StoredFileNotFoundError(f"No such file: {file_id!r}", param="file_id")
        return self.root / f"{file_id}.{suffix}"


def list_page(items: list[Any], after: str | None, limit: int, what: str) -> dict[str, Any]:
    """OpenAI's list object over `items` (each with .id and .to_wire(), in listing order): those after the id
    `after`, at most `limit`, and whether more follow."""
    if after is not None:
        position = next((i for i, item in enumerate(items) if item.id == after), None)
        if position is None:
            raise InvalidRequestError(f"No such {what} to list after: {after!r}", param="after")
        items = items[position + 1:]
    page = items[:limit]
    return {"object": "list", "data": [item.to_wire() for item in page], "has_more": len(items) > limit,
            "first_id": page[0].id if page else None, "last_id": page[-1].id if page else None}


def check_jsonl(data: bytes) -> None:
    """A batch file: UTF-8, each non-blank line one JSON object; the first line that is not is named."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(f"The file is not UTF-8 text (byte {exc.start})", param="file") from None
    lines = 0
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except ValueError as exc:
            raise InvalidRequestError(f"Line {number} is not JSON: {exc}", param="file") from None
        if not isinstance(value, dict):
            raise InvalidRequestError(f"Line {number} is not a JSON object", param="file")
        lines += 1
    if lines == 0:
        raise InvalidRequestError("The file holds no JSONL lines", param="file")


def write_atomically(path: Path, data: bytes) -> None:
    """A reader never sees half a file: written beside it, then renamed over it."""
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=".upload-")
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


__all__ = ["FILE_PURPOSES", "FileStore", "StoredFile", "check_jsonl", "list_page", "write_atomically"]
