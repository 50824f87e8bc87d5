"""The stream channel's socket directories: one private directory per ChannelServer, in the temp dir, named after
the process that owns it (orchard-channel-<pid>-<random>), removed when its channel closes or its process exits.

A replica that is SIGKILLed or crashes (Ray kills replicas of a server that stops, a failed health check, an
out-of-memory kill) runs neither, so every channel start first sweeps the directories whose owner died: without
that, each server start and death left one behind (issue 59). The sweep must never break a live channel, the
second Orchard server on this machine included, so it removes a directory only when every sign says it is dead.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import shutil
import socket
import stat
import tempfile
import time
from pathlib import Path

logger = logging.getLogger("ray.serve.orchard")
PREFIX = "orchard-channel-"
SOCKET_NAME = "stream.sock"
# The pid is absent from directories made before the pid was part of the name: their socket alone tells.
_NAME = re.compile(re.escape(PREFIX) + r"(?:(?P<pid>\d+)-)?[a-z0-9_]+")
# A directory younger than this may belong to a channel still starting (made, its socket not yet listening), in a
# process this one cannot see (another PID namespace sharing the temp dir): the sweep leaves it for a later start.
SWEEP_GRACE_S = 60.0

_owned: dict[Path, int] = {}  # the directories this process made and has not removed -> the pid that made them


def socket_root() -> Path:
    # The temp dir (per user on macOS): short enough for a Unix socket's path (104 bytes on macOS, 108 on Linux).
    return Path(tempfile.gettempdir())


def make_socket_dir(root: Path | None = None) -> Path:
    """A new directory (mode 0700: this user only) for one channel's socket, removed at exit if not before."""
    path = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=root or socket_root()))
    _owned[path] = os.getpid()
    return path


def remove_socket_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    _owned.pop(path, None)


@atexit.register
def _remove_owned_dirs() -> None:
    """A process exiting with a channel still open (Serve stopping a replica without its __del__) leaves nothing."""
    for path, pid in list(_owned.items()):
        if pid == os.getpid():  # a forked child inherits the table, not the directories
            remove_socket_dir(path)


def sweep_stale_socket_dirs(root: Path | None = None, grace_s: float = SWEEP_GRACE_S) -> list[Path]:
    """Remove the channel directories left by processes that died without removing them; returns those removed."""
    root = root or socket_root()
    try:
        entries = list(os.scandir(root))
    except OSError:
        return []  # an unreadable temp dir: the channel's own mkdtemp reports what is wrong
    removed = []
    for entry in entries:
        match = _NAME.fullmatch(entry.name)
        if match is not None and _is_stale(entry, match["pid"], grace_s):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(Path(entry.path))
    if removed:
        logger.info("stream channel: removed %d socket directories of dead processes", len(removed))
    return removed


def _is_stale(entry: os.DirEntry, pid: str | None, grace_s: float) -> bool:
    try:
        info = entry.stat(follow_symlinks=False)  # a symlink is never followed, so never removed
    except OSError:
        return False  # gone meanwhile
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        return False  # another user's, or not a directory: not ours to judge
    if time.time() - info.st_mtime < grace_s:
        return False
    if pid is not None and _process_alive(int(pid)):
        return False  # a pid taken over by another process keeps it too, until that one is gone
    return not _listening(Path(entry.path) / SOCKET_NAME)


def _process_alive(pid: int) -> bool:
    if pid <= 0:
        return True  # not a process's pid (kill(0) would signal our own group): keep the directory
    try:
        os.kill(pid, 0)  # signal 0: nothing is sent, only whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, another user's
    return True


def _listening(path: Path) -> bool:
    """Whether a server accepts connections on `path`: a dead one's socket file refuses them (or is gone)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.setblocking(False)  # a full backlog answers EAGAIN at once instead of waiting
        try:
            probe.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError):
            return False
        except OSError:
            return True  # a full backlog or anything unclear: keep the directory
    return True
