"""`orchard pull | ls | rm`: the local Hugging Face cache from the command line (deployments/hub underneath).

`ls` and `rm` read only the disk; `pull` talks to HF_ENDPOINT (the Hub by default) with HF_TOKEN, into HF_HUB_CACHE.
"""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from deployments.hub.events import (
    DownloadCompleted,
    DownloadEvent,
    DownloadFailed,
    DownloadProgress,
)
from engine.errors import OrchardError

BAR_WIDTH = 24


def add_parser(commands: argparse._SubParsersAction) -> None:
    pull = commands.add_parser("pull", help="download a Hugging Face model repo (MLX files) into the local cache")
    pull.add_argument("repo_id", help="owner/name on the Hub")
    pull.add_argument("--revision", default=None, help="branch, tag or commit (default: main)")
    commands.add_parser("ls", help="list the models in the local Hugging Face cache, with sizes")
    remove = commands.add_parser("rm", help="delete a model repo from the local Hugging Face cache")
    remove.add_argument("repo_id", help="owner/name")


def run(args: argparse.Namespace) -> int:
    try:
        if args.command == "pull":
            return _pull(args.repo_id, args.revision)
        if args.command == "ls":
            return _list()
        return _remove(args.repo_id)
    except OrchardError as exc:
        print(f"orchard {args.command}: error: {exc.message}", file=sys.stderr)
        return 1


def _pull(repo_id: str, revision: str | None) -> int:
    from deployments.hub.downloads import DownloadManager

    job = DownloadManager().start(repo_id, revision)
    bar = ProgressBar(sys.stderr)
    try:
        for event in job.subscribe():
            bar.show(event)
    except KeyboardInterrupt:
        job.cancel()
        job.wait()
        bar.finish()
        print(f"orchard pull: cancelled; files already complete stay in the cache ({repo_id})", file=sys.stderr)
        return 130
    bar.finish()
    final = job.latest
    if isinstance(final, DownloadFailed):
        raise final.error
    assert isinstance(final, DownloadCompleted)
    print(final.snapshot_path)
    return 0


def _list() -> int:
    from deployments.hub.cache import list_cached_models

    models = list_cached_models()
    if not models:
        print("no models in the local Hugging Face cache", file=sys.stderr)
        return 0
    width = max(len("REPO"), *(len(m.repo_id) for m in models))
    print(f"{'REPO':<{width}}  {'SIZE':>10}  {'DONE':>6}  STATUS      REVISION")
    for model in models:
        status = "complete" if model.is_complete else "incomplete"
        revision = ",".join(model.refs) or model.commit[:12]
        print(f"{model.repo_id:<{width}}  {model.size_gb:>7.3f} GB  {model.download_percentage:>5.1f}%  "
              f"{status:<10}  {revision}")
    return 0


def _remove(repo_id: str) -> int:
    from deployments.hub.cache import delete_cached_model

    freed = delete_cached_model(repo_id)
    print(f"deleted {repo_id} ({_size(freed)} freed)")
    return 0


class ProgressBar:
    """One line redrawn in place on a terminal; one line per event elsewhere (logs, pipes)."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._in_place = stream.isatty()
        self._drawn = False
        self._last_line = ""

    def show(self, event: DownloadEvent) -> None:
        line = render_progress(event)
        if line == self._last_line:  # e.g. a file's end after its last bytes: nothing new to show
            return
        self._last_line = line
        if self._in_place:
            self._stream.write("\r\x1b[K" + line)
        else:
            self._stream.write(line + "\n")
        self._stream.flush()
        self._drawn = True

    def finish(self) -> None:
        if self._in_place and self._drawn:
            self._stream.write("\n")
            self._stream.flush()


def render_progress(event: DownloadEvent) -> str:
    filled = round(BAR_WIDTH * event.percent / 100)
    bar = "[" + "#" * filled + "-" * (BAR_WIDTH - filled) + "]"
    if isinstance(event, DownloadCompleted):
        return (f"{event.repo_id} {bar} 100.0%  {_size(event.bytes_total)}  {event.files_total} files  "
                f"done in {event.elapsed_s:.1f}s")
    if isinstance(event, DownloadFailed):
        return f"{event.repo_id} {bar} {event.percent:5.1f}%  {event.status.value}"
    assert isinstance(event, DownloadProgress)
    if not event.bytes_total:
        return f"{event.repo_id} {bar}   0.0%  {event.status.value}"
    eta = f"ETA {event.eta_s:.0f}s" if event.eta_s is not None else "ETA ?"
    return (f"{event.repo_id} {bar} {event.percent:5.1f}%  {_size(event.bytes_done)} / {_size(event.bytes_total)}  "
            f"{_size(event.speed_bytes_per_s)}/s  {eta}  {event.current_file or ''}").rstrip()


def _size(n_bytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n_bytes >= scale:
            return f"{n_bytes / scale:.1f} {unit}"
    return f"{n_bytes:.0f} B"
