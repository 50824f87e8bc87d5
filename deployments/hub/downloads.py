"""Downloads from the Hugging Face Hub into its standard cache, in background threads, with typed progress events.

huggingface_hub does the transfer and keeps its conventions (HF_HUB_CACHE / HF_HOME, HF_TOKEN, HF_ENDPOINT,
refs and tree listing, `.incomplete` temp files, Range resumption of a dropped connection). A download:
1. resolves the revision to a commit and caches the repo's file listing (snapshot_download with no file allowed),
2. fetches each wanted file that is not cached yet (hf_hub_download), its byte counts feeding the events.
Two requests for one repo and revision share one download; a download goes on when its readers go away.
"""

from __future__ import annotations

import itertools
import logging
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Self

from deployments.hub.cache import (
    HubVerification,
    delete_cached_model,
    verify_with_hub,
)
from deployments.hub.errors import DiskFullError, DownloadCancelledError, DownloadInProgressError, typed_hub_error
from deployments.hub.events import (
    DownloadCompleted,
    DownloadEvent,
    DownloadFailed,
    DownloadProgress,
    DownloadStatus,
    SpeedMeter,
    Subscription,
)
from deployments.hub.paths import (
    MLX_ALLOW_PATTERNS,
    check_repo_id,
    check_revision,
    hub_cache_dir,
    hub_endpoint,
)
from engine.errors import OrchardError

PROGRESS_INTERVAL_S = 0.05  # at most ~20 byte events a second; file starts and ends and the final event always go out
FINISHED_KEPT = 100  # finished downloads listed for late readers before the oldest are forgotten


class _NoEmptyPatternWarning(logging.Filter):
    """_plan() asks snapshot_download for no file on purpose: its 'No files matched' warning is noise here."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "No files matched allow_patterns=[]" not in record.getMessage()


logging.getLogger("huggingface_hub._snapshot_download").addFilter(_NoEmptyPatternWarning())


class _Cancelled(Exception):
    """Raised from the progress hook inside huggingface_hub's transfer loop to stop it (its temp file is removed)."""


@dataclass(frozen=True)
class _PlannedFile:
    path: str
    size: int


class DownloadJob:
    """One transfer of a repo revision. Read it with subscribe(); the thread runs whether anyone reads or not."""

    def __init__(self, download_id: str, repo_id: str, revision: str, manager: DownloadManager,
                 token: str | None, allow_patterns: tuple[str, ...]) -> None:
        self.download_id = download_id
        self.repo_id = repo_id
        self.revision = revision
        self.allow_patterns = allow_patterns
        self.started_at = time.time()
        self._manager = manager
        self._token = token
        self._lock = threading.Lock()
        self._subscribers: list[Subscription] = []
        self._cancel = threading.Event()
        self._done = threading.Event()
        self._meter = SpeedMeter()
        self._last_emit = 0.0
        self._bytes_done = self._bytes_fetched = self._bytes_total = self._files_done = self._files_total = 0
        self._current_file: str | None = None
        self._status = DownloadStatus.RESOLVING
        self.latest: DownloadEvent = self._progress()
        self._bar_class = type("JobByteBar", (_ByteBar,), {"job": self})
        self._thread = threading.Thread(target=self._run, name=f"hub-download-{download_id}", daemon=True)

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    def subscribe(self) -> Subscription:
        """A queue of this download's events from now on, starting with the latest one (the final one if done)."""
        subscription = Subscription()
        with self._lock:
            subscription.put(self.latest)
            if not self.latest.final:
                self._subscribers.append(subscription)
        return subscription

    def cancel(self) -> None:
        """Stop at the next chunk received; the final event says CANCELLED. Files already complete stay cached."""
        self._cancel.set()

    def wait(self, timeout: float | None = None) -> DownloadEvent:
        """Block until the download ends (or `timeout`); the latest event."""
        self._done.wait(timeout)
        return self.latest

    async def wait_async(self) -> DownloadEvent:
        """The final event, awaited on the caller's event loop (no thread blocked)."""
        async for event in self.subscribe():
            if event.final:
                return event
        raise AssertionError("a subscription always ends with the final event")

    def _emit(self, event: DownloadEvent, force: bool = False) -> None:
        with self._lock:
            now = time.monotonic()
            if not (force or event.final or now - self._last_emit >= PROGRESS_INTERVAL_S):
                return
            self._last_emit = now
            self.latest = event
            subscribers = list(self._subscribers)
            if event.final:
                self._subscribers.clear()
        for subscription in subscribers:
            subscription.put(event)

    def _progress(self) -> DownloadProgress:
        return DownloadProgress(
            download_id=self.download_id, repo_id=self.repo_id, revision=self.revision, status=self._status,
            bytes_done=self._bytes_done, bytes_total=self._bytes_total, files_done=self._files_done,
            files_total=self._files_total, current_file=self._current_file,
            speed_bytes_per_s=round(self._meter.speed(), 1),
            eta_s=self._meter.eta_s(self._bytes_total - self._bytes_done))

    def _on_bytes(self, n: int) -> None:
        """huggingface_hub's per-chunk byte count (negative when a server ignored a Range and the file restarts)."""
        if self._cancel.is_set():
            raise _Cancelled()
        self._bytes_done += n
        self._bytes_fetched += n
        self._meter.add(self._bytes_fetched)
        self._emit(self._progress())

    def _run(self) -> None:
        try:
            completed = self._download()
        except _Cancelled:
            self._fail(DownloadStatus.CANCELLED, DownloadCancelledError(
                f"the download of '{self.repo_id}' was cancelled", param="repo_id"))
        except Exception as exc:  # noqa: BLE001 -- every failure becomes the final event: no reader waits forever
            self._fail(DownloadStatus.FAILED, typed_hub_error(
                exc, self.repo_id, self._manager.cache_dir, self._manager.endpoint))
        else:
            self._emit(completed)
        finally:
            self._done.set()
            self._manager._finished(self)

    def _fail(self, status: DownloadStatus, error: OrchardError) -> None:
        self._emit(DownloadFailed(
            download_id=self.download_id, repo_id=self.repo_id, revision=self.revision, status=status, error=error,
            bytes_done=self._bytes_done, bytes_total=self._bytes_total))

    def _download(self) -> DownloadCompleted:
        from huggingface_hub import hf_hub_download

        started = time.monotonic()
        snapshot, files = self._plan()
        commit = snapshot.name
        cached = [f for f in files if (snapshot / f.path).is_file()]
        self._status = DownloadStatus.DOWNLOADING
        self._files_total, self._bytes_total = len(files), sum(f.size for f in files)
        self._files_done, self._bytes_done = len(cached), sum(f.size for f in cached)
        self._check_free_space(self._bytes_total - self._bytes_done)
        self._emit(self._progress(), force=True)
        for planned in (f for f in files if f not in cached):
            if self._cancel.is_set():
                raise _Cancelled()
            self._current_file = planned.path
            file_start = self._bytes_done
            self._emit(self._progress(), force=True)
            hf_hub_download(self.repo_id, planned.path, revision=commit, cache_dir=self._manager.cache_dir,
                            endpoint=self._manager.endpoint, token=self._token, tqdm_class=self._bar_class)
            self._bytes_done = file_start + planned.size  # exact even where a retry recounted bytes
            self._files_done += 1
            self._emit(self._progress(), force=True)
        self._current_file = None
        return DownloadCompleted(
            download_id=self.download_id, repo_id=self.repo_id, revision=self.revision, commit=commit,
            snapshot_path=snapshot, bytes_total=self._bytes_total, bytes_downloaded=self._bytes_fetched,
            files_total=self._files_total, elapsed_s=round(time.monotonic() - started, 3))

    def _check_free_space(self, needed: int) -> None:
        """Refuse before transferring what cannot fit (huggingface_hub only warns); a disk that fills up during the
        transfer still ends in DiskFullError, from the failed write."""
        free = shutil.disk_usage(self._manager.cache_dir).free
        if free < needed:
            raise DiskFullError(
                f"'{self.repo_id}' needs {_gb(needed)} more but the Hugging Face cache {self._manager.cache_dir} has "
                f"{_gb(free)} free: free disk space or set HF_HUB_CACHE elsewhere", param="repo_id")

    def _plan(self) -> tuple[Path, list[_PlannedFile]]:
        """The revision's snapshot folder (named by its commit) and the wanted files, smallest first, from the Hub
        (the listing cached as huggingface_hub does)."""
        from huggingface_hub import get_cached_repo_tree, snapshot_download
        from huggingface_hub.utils import filter_repo_objects

        # No file allowed: only repo_info + the tree listing, written to the cache with refs/<revision>.
        snapshot = Path(snapshot_download(
            self.repo_id, revision=self.revision, cache_dir=self._manager.cache_dir, endpoint=self._manager.endpoint,
            token=self._token, allow_patterns=[], tqdm_class=_SilentBar))
        tree = get_cached_repo_tree(self.repo_id, revision=snapshot.name, cache_dir=self._manager.cache_dir)
        wanted = filter_repo_objects(tree, allow_patterns=list(self.allow_patterns), key=lambda f: f.path)
        return snapshot, sorted((_PlannedFile(f.path, f.size) for f in wanted), key=lambda f: (f.size, f.path))


class _SilentBar:
    """A tqdm stand-in that shows nothing: what huggingface_hub calls on a `tqdm_class` bar, over plain HTTP and
    over Xet (where a class with `update_transfer` gets one bar per file, as snapshot_download's own aggregator)."""

    total: float | None = None
    n = 0

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.total = kwargs.get("total")  # type: ignore[assignment]

    def update(self, n: float | None = 1) -> None:
        pass

    def update_transfer(self, n: float | None = 1) -> None:
        """Network bytes (Xet's may differ from the file's); progress counts the file's bytes, from update()."""

    def set_postfix_str(self, *args: object, **kwargs: object) -> None:
        pass

    set_transfer_postfix_str = set_description = set_description_str = set_postfix_str

    def refresh(self) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class _ByteBar(_SilentBar):
    """The per-file `tqdm_class` of one job (a subclass per job names it: huggingface_hub wants a class)."""

    job: DownloadJob

    def update(self, n: float | None = 1) -> None:
        self.job._on_bytes(int(n or 0))


class DownloadManager:
    """Background downloads into one hub cache, deduplicated by (repo id, revision)."""

    def __init__(self, cache_dir: Path | None = None, endpoint: str | None = None, token: str | None = None,
                 allow_patterns: list[str] | None = None) -> None:
        self.cache_dir = Path(cache_dir) if cache_dir is not None else hub_cache_dir()
        self.endpoint = endpoint or hub_endpoint()
        self.token = token  # None: huggingface_hub reads HF_TOKEN (or its token file) at each call
        self.allow_patterns = list(allow_patterns or MLX_ALLOW_PATTERNS)
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._active: dict[tuple[str, str, tuple[str, ...]], DownloadJob] = {}
        self._jobs: dict[str, DownloadJob] = {}

    def start(self, repo_id: str, revision: str | None = None, token: str | None = None,
              files: list[str] | None = None) -> DownloadJob:
        """The running download of this repo and revision, or a new one (the `token` of a merged request is
        not used: the first request's token downloads). `files`: only these files of the repo (one GGUF of
        many, say) instead of what an MLX model needs."""
        return self.start_watched(repo_id, revision, token, files)[0]

    def start_watched(self, repo_id: str, revision: str | None = None, token: str | None = None,
                      files: list[str] | None = None) -> tuple[DownloadJob, Subscription]:
        """start(), with a subscription taken before a new download's thread runs: a stream of it opens with its
        first event even when it fails at once (an unknown repo)."""
        check_repo_id(repo_id, param="repo_id")
        revision = check_revision(revision)
        patterns = tuple(files) if files else tuple(self.allow_patterns)
        with self._lock:
            job = self._active.get((repo_id, revision, patterns))
            if job is not None and not job.latest.final:  # one whose final event is out is over, if not yet removed
                return job, job.subscribe()
            job = DownloadJob(f"dl-{next(self._ids)}", repo_id, revision, self, token or self.token, patterns)
            self._active[(repo_id, revision, patterns)] = job
            self._jobs[job.download_id] = job
            subscription = job.subscribe()
        job._thread.start()
        return job, subscription

    def download(self, repo_id: str, revision: str | None = None, token: str | None = None,
                 files: list[str] | None = None) -> DownloadCompleted:
        """start() and wait: the completed event, or the download's typed error raised."""
        final = self.start(repo_id, revision, token, files).wait()
        if isinstance(final, DownloadFailed):
            raise final.error
        assert isinstance(final, DownloadCompleted)
        return final

    def get(self, download_id: str) -> DownloadJob | None:
        with self._lock:
            return self._jobs.get(download_id)

    def downloads(self) -> list[DownloadJob]:
        """Running downloads and the most recent finished ones, oldest first."""
        with self._lock:
            return list(self._jobs.values())

    def cancel(self, download_id: str) -> bool:
        """False where no such download runs (unknown or finished)."""
        job = self.get(download_id)
        if job is None or job.finished:
            return False
        job.cancel()
        return True

    def is_downloading(self, repo_id: str) -> bool:
        with self._lock:
            return any(key[0] == repo_id and not job.latest.final for key, job in self._active.items())

    def delete(self, repo_id: str) -> int:
        """Delete a repo from the cache (every revision); the bytes freed. Refused while it downloads."""
        check_repo_id(repo_id, param="repo_id")
        if self.is_downloading(repo_id):
            raise DownloadInProgressError(
                f"'{repo_id}' is downloading: cancel the download before deleting it", param="repo_id")
        return delete_cached_model(repo_id, self.cache_dir)

    def verify(self, repo_id: str, revision: str | None = None) -> HubVerification:
        """The cached repo against the Hub now (network; downloads nothing)."""
        return verify_with_hub(repo_id, revision, self.cache_dir, self.endpoint, self.token, self.allow_patterns)

    def _finished(self, job: DownloadJob) -> None:
        with self._lock:
            key = (job.repo_id, job.revision, job.allow_patterns)
            if self._active.get(key) is job:  # a newer one may have taken its place
                del self._active[key]
            finished = [j for j in self._jobs.values() if j.finished]
            for old in finished[:max(0, len(finished) - FINISHED_KEPT)]:
                del self._jobs[old.download_id]


def _gb(n_bytes: int) -> str:
    return f"{n_bytes / 1e9:.3f} GB"
