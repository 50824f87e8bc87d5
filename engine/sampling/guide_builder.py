"""Builds outlines-core indexes in child processes with a memory cap and a time limit.

A structured-output index can need minutes and gigabytes (issue 48: one JSON schema took the whole server down).
guide_limits.py refuses the absurd constraints before this; what passes is built here, in a small Python process
that imports only outlines-core, under RLIMIT_AS and a deadline: a build over either kills that child alone (the
request gets a 400 naming the limit) and the next build starts a fresh one. The index comes back pickled (a
schema's ~0.3 MB in ~1 ms; a 200 MB one in ~1 s). No MLX here.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import struct
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import IO, Any

from outlines_core import Index, Vocabulary

from engine.errors import InvalidRequestError

logger = logging.getLogger(__name__)

# A build may take this long (on the 2-core test machine a 1,024-character string index took ~4.5 s, 200 MB).
BUILD_SECONDS = 20.0
# And this much address space: an eighth of the machine's memory, between 1 and 4 GiB.
MEMORY_BOUNDS = (1 << 30, 4 << 30)

# The child: reads the vocabulary, then regexes; answers ("ok", index) or ("error", message). It imports nothing
# of Orchard, so it starts in ~0.1 s; a build over RLIMIT_AS aborts it (Rust aborts on a failed allocation), and
# where the kernel does not enforce RLIMIT_AS (macOS) a resident-size watchdog ends it.
_CHILD_SOURCE = r"""
import os, pickle, resource, struct, sys, threading, time
def rss():  # resident bytes now (Linux); the peak elsewhere (macOS: bytes)
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024
def watch(limit):  # macOS does not enforce RLIMIT_AS: the cap holds there through this
    while True:
        if rss() > limit:
            os._exit(86)
        time.sleep(0.05)
def read():
    head = sys.stdin.buffer.read(8)
    if len(head) < 8:
        sys.exit(0)
    return pickle.loads(sys.stdin.buffer.read(struct.unpack("<Q", head)[0]))
def write(reply):
    data = pickle.dumps(reply, protocol=5)
    sys.stdout.buffer.write(struct.pack("<Q", len(data)) + data)
    sys.stdout.buffer.flush()
limit = int(sys.argv[1])
try:
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
except (ValueError, OSError):
    pass
threading.Thread(target=watch, args=(limit,), daemon=True).start()
from outlines_core import Index
vocabulary = read()
while True:
    regex = read()
    try:
        write(("ok", Index(regex, vocabulary)))
    except MemoryError:
        write(("memory", ""))
    except Exception as exc:
        write(("error", str(exc).splitlines()[0] if str(exc) else type(exc).__name__))
"""


class GuideBuildError(Exception):
    """The regex cannot become an index (bad syntax, or no token can start it): the message says why."""


@dataclass(frozen=True)
class BuiltIndex:
    index: Index
    size_bytes: int  # its pickled size: what it holds in memory, roughly


def default_memory_bytes() -> int:
    low, high = MEMORY_BOUNDS
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return low
    return max(low, min(high, total // 8))


class _BuildProcess:
    """One child process and the pipes to it."""

    def __init__(self, vocabulary: bytes, memory_bytes: int) -> None:
        self.child = subprocess.Popen(
            [sys.executable, "-c", _CHILD_SOURCE, str(memory_bytes)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        )
        self.timed_out = False
        _send(self.child.stdin, vocabulary)

    def build(self, regex: str, seconds: float) -> tuple[str, Any, int] | None:
        """(status, payload, reply bytes), or None when the child died or ran out of time."""
        timer = threading.Timer(seconds, self._time_out)
        timer.start()
        try:
            _send(self.child.stdin, pickle.dumps(regex))
            data = _receive(self.child.stdout)
        except (BrokenPipeError, OSError):
            data = None
        finally:
            timer.cancel()
        if data is None:
            return None
        status, payload = pickle.loads(data)
        return status, payload, len(data)

    def _time_out(self) -> None:
        self.timed_out = True
        self.child.kill()

    def stop(self) -> None:
        self.child.kill()
        self.child.wait()


class GuideBuilder:
    """Up to `workers` child processes for one vocabulary, each building one index at a time."""

    def __init__(self, vocabulary: Vocabulary, workers: int, memory_bytes: int | None = None,
                 seconds: float = BUILD_SECONDS) -> None:
        self.memory_bytes = memory_bytes or default_memory_bytes()
        self.seconds = seconds
        self._vocabulary = pickle.dumps(vocabulary)
        self._idle: queue.LifoQueue[_BuildProcess | None] = queue.LifoQueue()
        for _ in range(workers):
            self._idle.put(None)  # started on first use

    def build(self, regex: str, param: str) -> BuiltIndex:
        """The index of `regex`; raises GuideBuildError for a bad regex, InvalidRequestError over a limit."""
        worker = self._idle.get()
        try:
            worker = worker or _BuildProcess(self._vocabulary, self.memory_bytes)
            reply = worker.build(regex, self.seconds)
            if reply is None or reply[0] == "memory":
                timed_out = worker.timed_out
                worker.stop()
                worker = None
                raise InvalidRequestError(self._over_limit(param, timed_out), param=param)
            status, payload, size = reply
            if status == "error":
                raise GuideBuildError(payload)
            return BuiltIndex(payload, size)
        finally:
            self._idle.put(worker)

    def close(self) -> None:
        while not self._idle.empty():
            worker = self._idle.get_nowait()
            if worker is not None:
                worker.stop()

    def _over_limit(self, param: str, timed_out: bool) -> str:
        if timed_out:
            limit = f"took longer than the limit of {self.seconds:g} s"
        else:
            limit = f"needed more memory than the limit of {_size(self.memory_bytes)}"
        logger.warning("structured output: a constraint for '%s' %s", param, limit)
        return f"Invalid '{param}': compiling the output constraint {limit}; make it smaller or less repetitive"


def _size(size_bytes: int) -> str:
    return f"{size_bytes / 2**30:.1f} GiB" if size_bytes >= 2**30 else f"{size_bytes >> 20} MiB"


def _send(pipe: IO[bytes] | None, data: bytes) -> None:
    assert pipe is not None
    pipe.write(struct.pack("<Q", len(data)) + data)
    pipe.flush()


def _receive(pipe: IO[bytes] | None) -> bytes | None:
    assert pipe is not None
    head = pipe.read(8)
    if len(head) < 8:
        return None
    size = struct.unpack("<Q", head)[0]
    data = pipe.read(size)
    return data if len(data) == size else None


__all__ = ["BUILD_SECONDS", "BuiltIndex", "GuideBuildError", "GuideBuilder", "default_memory_bytes"]
