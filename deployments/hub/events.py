"""What a download reports: typed progress events, the meter that computes speed and ETA, and the per-subscriber
queue that carries events from the download thread to a sync or asyncio reader."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from engine.errors import OrchardError

SPEED_WINDOW_S = 5.0  # speed is measured over the last few seconds, so a stall shows quickly


class DownloadStatus(str, Enum):
    RESOLVING = "resolving"  # asking the Hub which commit and files the revision holds
    DOWNLOADING = "downloading"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class DownloadProgress:
    download_id: str
    repo_id: str
    revision: str
    status: DownloadStatus  # RESOLVING or DOWNLOADING
    bytes_done: int
    bytes_total: int  # 0 until the file list is known
    files_done: int
    files_total: int
    current_file: str | None
    speed_bytes_per_s: float
    eta_s: float | None  # None while the speed is unknown
    final = False

    @property
    def percent(self) -> float:
        return _percent(self.bytes_done, self.bytes_total)


@dataclass(frozen=True)
class DownloadCompleted:
    download_id: str
    repo_id: str
    revision: str
    commit: str
    snapshot_path: Path  # the folder to load: <cache>/models--owner--name/snapshots/<commit>
    bytes_total: int
    bytes_downloaded: int  # what this download fetched (less than bytes_total where files were cached)
    files_total: int
    elapsed_s: float
    status = DownloadStatus.COMPLETED
    final = True
    percent = 100.0


@dataclass(frozen=True)
class DownloadFailed:
    download_id: str
    repo_id: str
    revision: str
    status: DownloadStatus  # FAILED or CANCELLED
    error: OrchardError  # a HubError subclass (deployments/hub/errors.py) or InvalidRequestError
    bytes_done: int
    bytes_total: int
    final = True

    @property
    def percent(self) -> float:
        return _percent(self.bytes_done, self.bytes_total)


DownloadEvent = DownloadProgress | DownloadCompleted | DownloadFailed


def _percent(done: int, total: int) -> float:
    return round(100.0 * done / total, 1) if total else 0.0


class SpeedMeter:
    """Bytes per second over a sliding window, and the ETA it implies."""

    def __init__(self) -> None:
        self._samples: deque[tuple[float, int]] = deque()

    def add(self, bytes_done: int) -> None:
        now = time.monotonic()
        self._samples.append((now, bytes_done))
        while len(self._samples) > 2 and now - self._samples[0][0] > SPEED_WINDOW_S:
            self._samples.popleft()

    def speed(self) -> float:
        if len(self._samples) < 2:
            return 0.0
        (t0, b0), (t1, b1) = self._samples[0], self._samples[-1]
        return (b1 - b0) / (t1 - t0) if t1 > t0 else 0.0

    def eta_s(self, remaining: int) -> float | None:
        speed = self.speed()
        return round(remaining / speed, 1) if speed > 0 else None


class Subscription:
    """One reader's events, in order. A slow reader never holds the download back: once `max_pending` events
    wait, a new progress event replaces the newest waiting progress event (the final event is always kept)."""

    def __init__(self, max_pending: int = 256) -> None:
        self._events: deque[DownloadEvent] = deque()
        self._max_pending = max_pending
        self._cond = threading.Condition()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._closed = False  # set once the final event is queued

    def put(self, event: DownloadEvent) -> None:
        with self._cond:
            if self._closed:
                return
            if (len(self._events) >= self._max_pending and not event.final
                    and isinstance(self._events[-1], DownloadProgress)):
                self._events[-1] = event
            else:
                self._events.append(event)
            self._closed = event.final
            self._cond.notify_all()
            waiters, self._waiters = self._waiters, []
        for loop, future in waiters:
            loop.call_soon_threadsafe(_wake, future)

    def get(self, timeout: float | None = None) -> DownloadEvent | None:
        """The next event, or None after `timeout` seconds without one."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._events, timeout=timeout):
                return None
            return self._events.popleft()

    async def get_async(self) -> DownloadEvent:
        while True:
            with self._cond:
                if self._events:
                    return self._events.popleft()
                future = asyncio.get_running_loop().create_future()
                self._waiters.append((asyncio.get_running_loop(), future))
            await future

    def __iter__(self) -> Iterator[DownloadEvent]:
        """Every event up to and including the final one."""
        while True:
            event = self.get()
            assert event is not None
            yield event
            if event.final:
                return

    async def __aiter__(self) -> AsyncIterator[DownloadEvent]:
        while True:
            event = await self.get_async()
            yield event
            if event.final:
                return


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
