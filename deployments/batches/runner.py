"""BatchRunner: each batch's lines sent through the ingress's own routes (`send`), a bounded number at once, their
answers appended to the batch's output and error files as they come, so that the answers equal those of the same
requests sent one by one, and a restarted ingress resumes a batch where its files end.

A line that is not a request of the batch's endpoint (no unique custom_id, another method or URL, a body that is not
an object or asks to stream) goes to the error file with the reason; the others run. Cancelling stops the lines
in flight and keeps what finished; stopping the ingress leaves a batch in progress for the next start.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable

from deployments.batches.batches import (
    BATCH_ENDPOINTS, COMPLETION_WINDOWS, TERMINAL, BatchRecord, BatchStore, RequestCounts,
)
from deployments.batches.files import FileStore
from engine.errors import InvalidRequestError

logger = logging.getLogger("ray.serve.orchard")
Send = Callable[[str, dict[str, Any]], Awaitable[tuple[int, dict[str, Any]]]]
DEFAULT_CONCURRENCY = 16  # lines in flight per batch: the engine batches them like any concurrent requests
SAVE_EVERY_S = 1.0  # request_counts reach the stored object at most this late


@dataclass
class BatchLine:
    number: int
    custom_id: str
    body: dict[str, Any]


def parse_lines(data: bytes, endpoint: str) -> tuple[list[BatchLine], list[dict[str, Any]]]:
    """The batch's requests, and an error-file entry for each line that is not one."""
    lines: list[BatchLine] = []
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()
    for number, text in enumerate(data.decode("utf-8", errors="replace").splitlines(), start=1):
        if not text.strip():
            continue
        try:
            request = json.loads(text)
        except ValueError:
            request = None
        custom_id = request.get("custom_id") if isinstance(request, dict) else None
        reason = _line_problem(request, custom_id, endpoint, seen)
        if reason is not None:
            errors.append(_entry(custom_id if isinstance(custom_id, str) else None, None,
                                 {"code": "invalid_request", "message": f"line {number}: {reason}", "line": number}))
            continue
        seen.add(custom_id)
        lines.append(BatchLine(number, custom_id, request["body"]))
    return lines, errors


def _line_problem(request: Any, custom_id: Any, endpoint: str, seen: set[str]) -> str | None:
    if not isinstance(request, dict):
        return "not a JSON object"
    if not isinstance(custom_id, str) or not custom_id:
        return "custom_id must be a non-empty string"
    if custom_id in seen:
        return f"custom_id {custom_id!r} repeats an earlier line's"
    if request.get("method") != "POST":
        return "method must be POST"
    if request.get("url") != endpoint:
        return f"url must be the batch's endpoint {endpoint}"
    body = request.get("body")
    if not isinstance(body, dict):
        return "body must be a JSON object"
    if body.get("stream"):
        return "a batch request cannot stream"
    return None


def _entry(custom_id: str | None, response: dict[str, Any] | None, error: dict[str, Any] | None) -> dict[str, Any]:
    return {"id": f"batch_req_{secrets.token_hex(12)}", "custom_id": custom_id, "response": response, "error": error}


def _work_file(path: Path) -> tuple[set[str], int]:
    """A work file's answered custom_ids and its whole entries, in one read. A malformed line's entry is no answer
    (its custom_id may repeat a good line's); a last line cut by a crash is no entry."""
    answered, entries = set(), 0
    if path.exists():
        for text in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                entry = json.loads(text)
            except ValueError:
                continue
            if isinstance(entry, dict):
                entries += 1
                if entry.get("response") is not None and isinstance(entry.get("custom_id"), str):
                    answered.add(entry["custom_id"])
    return answered, entries


class BatchRunner:
    def __init__(self, batches: BatchStore, files: FileStore, send: Send,
                 concurrency: int = DEFAULT_CONCURRENCY) -> None:
        self.batches, self.files = batches, files
        self._send = send
        self._concurrency = concurrency
        self._tasks: dict[str, asyncio.Task] = {}
        self._resumed = False
        self._stopping = False

    def create(self, input_file_id: str, endpoint: str, completion_window: str,
               metadata: dict[str, str] | None) -> BatchRecord:
        if endpoint not in BATCH_ENDPOINTS:
            raise InvalidRequestError(f"endpoint must be one of {list(BATCH_ENDPOINTS)}", param="endpoint")
        if completion_window not in COMPLETION_WINDOWS:
            raise InvalidRequestError(f"completion_window must be one of {list(COMPLETION_WINDOWS)}",
                                      param="completion_window")
        stored = self.files.get(input_file_id)
        if stored.purpose != "batch":
            raise InvalidRequestError("input_file_id must name a file uploaded with purpose 'batch'",
                                      param="input_file_id")
        now = int(time.time())
        record = BatchRecord(f"batch_{secrets.token_hex(12)}", endpoint, input_file_id, completion_window,
                             "validating", now, now + COMPLETION_WINDOWS[completion_window], metadata)
        self.batches.save(record)
        self._start(record)
        return record

    def cancel(self, batch_id: str) -> BatchRecord:
        record = self.batches.get(batch_id)
        if record.status in TERMINAL or record.status == "cancelling":
            if record.status in ("cancelled", "cancelling"):
                return record
            raise InvalidRequestError(f"Cannot cancel a batch that is {record.status}", param="batch_id")
        record.mark("cancelling")
        self.batches.save(record)
        task = self._tasks.get(batch_id)
        if task is not None:
            task.cancel()
        else:
            self._start(record)  # not running here: its task only finishes the cancel
        return record

    def resume(self) -> None:
        """Start every batch a previous ingress left unfinished (once)."""
        if self._resumed:
            return
        self._resumed = True
        for record in self.batches.all():
            if record.status not in TERMINAL and record.id not in self._tasks:
                logger.info("batch %s: resuming (%s)", record.id, record.status)
                self._start(record)

    async def close(self) -> None:
        """The ingress stops: batches stay where they are, resumed at the next start."""
        self._stopping = True
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _start(self, record: BatchRecord) -> None:
        task = asyncio.get_running_loop().create_task(self._run(record))
        self._tasks[record.id] = task
        task.add_done_callback(lambda _: self._tasks.pop(record.id, None))

    async def _run(self, record: BatchRecord) -> None:
        try:
            if record.status == "cancelling":
                raise asyncio.CancelledError
            if time.time() > record.expires_at:
                await self._finish(record, "expired")
                return
            await self._run_lines(record)
            await self._finish(record, "completed")
        except asyncio.CancelledError:
            if self._stopping:
                raise
            await self._finish(self.batches.get(record.id), "cancelled")
        except Exception as exc:  # noqa: BLE001 - the batch fails with the reason; the ingress goes on
            logger.exception("batch %s failed", record.id)
            record.errors = [{"code": "server_error", "message": f"{type(exc).__name__}: {exc}"[:500],
                              "param": None, "line": None}]
            record.mark("failed")
            self.batches.save(record)

    async def _run_lines(self, record: BatchRecord) -> None:
        work = self.batches.work_dir(record.id)
        output, errors = work / "output.jsonl", work / "errors.jsonl"
        lines, malformed = parse_lines(self.files.content_path(record.input_file_id).read_bytes(), record.endpoint)
        if record.status == "validating":
            with errors.open("w", encoding="utf-8") as out:
                out.writelines(json.dumps(entry) + "\n" for entry in malformed)
            record.mark("in_progress")
        (done_ok, completed), (done_failed, failed) = _work_file(output), _work_file(errors)
        record.request_counts = RequestCounts(len(lines) + len(malformed), completed, failed)
        self.batches.save(record)
        done = done_ok | done_failed
        pending = iter([line for line in lines if line.custom_id not in done])
        progress = _Progress(self.batches, record)

        async def worker() -> None:  # `concurrency` of these take the lines in turn: memory flat in the batch's size
            for line in pending:
                status, body = await self._send(record.endpoint, line.body)
                response = {"status_code": status, "request_id": secrets.token_hex(16), "body": body}
                ok = 200 <= status < 300
                with (output if ok else errors).open("a", encoding="utf-8") as out:
                    out.write(json.dumps(_entry(line.custom_id, response, None)) + "\n")
                progress.count(ok)

        # A cancel cancels the gather, and with it every line in flight.
        await asyncio.gather(*(worker() for _ in range(self._concurrency)))
        progress.save()

    async def _finish(self, record: BatchRecord, status: str) -> None:
        """The work files become the batch's output and error files (a completed batch is `finalizing` meanwhile);
        its counts are what they hold."""
        if status == "completed":
            record.mark("finalizing")
            self.batches.save(record)
        work = self.batches.work_dir(record.id)
        output, errors = _work_file(work / "output.jsonl")[1], _work_file(work / "errors.jsonl")[1]
        record.request_counts = RequestCounts(max(record.request_counts.total, output + errors), output, errors)
        for name, attribute in (("output.jsonl", "output_file_id"), ("errors.jsonl", "error_file_id")):
            path = work / name
            if path.exists() and path.stat().st_size > 0:
                kept = await asyncio.to_thread(self.files.keep, path, f"{record.id}_{name}", "batch_output")
                setattr(record, attribute, kept.id)
        record.mark(status)
        self.batches.save(record)
        logger.info("batch %s %s: %s", record.id, status, record.request_counts)


class _Progress:
    """request_counts as lines finish, saved at most once a second."""

    def __init__(self, batches: BatchStore, record: BatchRecord) -> None:
        self._batches, self._record = batches, record
        self._saved_at = time.monotonic()

    def count(self, ok: bool) -> None:
        counts = self._record.request_counts
        if ok:
            counts.completed += 1
        else:
            counts.failed += 1
        if time.monotonic() - self._saved_at > SAVE_EVERY_S:
            self.save()

    def save(self) -> None:
        current = self._batches.get(self._record.id)  # a cancel may have come meanwhile: its status stands
        current.request_counts = self._record.request_counts
        self._batches.save(current)
        self._saved_at = time.monotonic()


__all__ = ["BatchRunner", "DEFAULT_CONCURRENCY", "parse_lines"]
