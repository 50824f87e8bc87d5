"""The Batches API's objects and their store: OpenAI's Batch (statuses validating -> in_progress -> finalizing ->
completed, or failed / cancelling -> cancelled / expired; request_counts; output and error files), each kept as
JSON under the ingress's state dir (`batches/<id>.json`), with its work folder (`batches/<id>/`) holding the output
and error lines written so far, so that a restarted ingress resumes a batch without redoing a finished line."""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from deployments.api.errors import BatchNotFoundError
from deployments.batches.files import write_atomically

BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
COMPLETION_WINDOWS = {"24h": 24 * 3600}
TERMINAL = frozenset({"completed", "failed", "cancelled", "expired"})
BATCH_ID = re.compile(r"batch_[0-9a-f]{24}")


@dataclass
class RequestCounts:
    total: int = 0
    completed: int = 0
    failed: int = 0


@dataclass
class BatchRecord:
    """OpenAI's Batch object, as kept."""

    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: str
    created_at: int
    expires_at: int
    metadata: dict[str, str] | None = None
    request_counts: RequestCounts = field(default_factory=RequestCounts)
    errors: list[dict[str, Any]] = field(default_factory=list)  # why the batch failed as a whole
    output_file_id: str | None = None
    error_file_id: str | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None

    def to_wire(self) -> dict[str, Any]:
        wire = asdict(self)
        wire["object"] = "batch"
        wire["errors"] = {"object": "list", "data": self.errors} if self.errors else None
        return wire

    def mark(self, status: str) -> None:
        """Move to `status`, stamping its `<status>_at` time where OpenAI's object has one."""
        self.status = status
        stamp = f"{status}_at"
        if stamp in self.__dataclass_fields__:
            setattr(self, stamp, int(time.time()))


class BatchStore:
    def __init__(self, root: Path) -> None:
        self.root = root

    def save(self, record: BatchRecord) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        write_atomically(self.root / f"{record.id}.json", json.dumps(asdict(record)).encode())

    def get(self, batch_id: str) -> BatchRecord:
        if not BATCH_ID.fullmatch(batch_id):
            raise BatchNotFoundError(f"No such batch: {batch_id!r}", param="batch_id")
        try:
            data = json.loads((self.root / f"{batch_id}.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            raise BatchNotFoundError(f"No such batch: {batch_id!r}", param="batch_id") from None
        data["request_counts"] = RequestCounts(**data["request_counts"])
        return BatchRecord(**data)

    def work_dir(self, batch_id: str) -> Path:
        path = self.root / batch_id
        path.mkdir(parents=True, exist_ok=True)
        return path

    def all(self) -> list[BatchRecord]:
        """Every batch, newest first."""
        ids = [p.stem for p in self.root.glob("batch_*.json")] if self.root.is_dir() else []
        records = [self.get(i) for i in ids if BATCH_ID.fullmatch(i)]
        return sorted(records, key=lambda r: (r.created_at, r.id), reverse=True)


__all__ = ["BATCH_ENDPOINTS", "COMPLETION_WINDOWS", "TERMINAL", "BatchRecord", "BatchStore", "RequestCounts"]
