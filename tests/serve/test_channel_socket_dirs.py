"""The stream channel's socket directories (transport/socket_dirs.py): a closed channel leaves nothing, nor does a
process that exits with its channel open, and the directory of a process that was SIGKILLed is swept at the next
channel start, while a live process's directory is kept. The channels here are real ChannelServers, in this
process or in a child Python process (the replica's part), on the real temp dir.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from deployments.transport.channel import ChannelServer
from deployments.transport.socket_dirs import SOCKET_NAME, SWEEP_GRACE_S, sweep_stale_socket_dirs

ROOT = Path(__file__).resolve().parents[2]
# A replica's part: start a channel, print its socket's path, hold it open until stdin closes, then exit without
# closing it (as Serve stopping a replica without its __del__).
CHILD = """
import asyncio, sys
from deployments.transport.channel import ChannelServer

async def nothing(job):
    return
    yield

async def main():
    address = await ChannelServer(nothing, "node-child").start()
    print(address.path, flush=True)
    sys.stdin.readline()

asyncio.run(main())
"""


async def _nothing(job):
    return
    yield


def _start_and_close() -> Path:
    """A channel started (sweeping first) and closed in this process; returns its directory."""

    async def main() -> Path:
        server = ChannelServer(_nothing, "node-here")
        address = await server.start()
        await server.close(drain_s=0.0)
        return Path(address.path).parent

    return asyncio.run(main())


def _child_channel() -> tuple[subprocess.Popen, Path]:
    child = subprocess.Popen([sys.executable, "-c", CHILD], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    path = child.stdout.readline().strip()
    assert path, f"the child started no channel (exit {child.poll()})"
    return child, Path(path).parent


def _age(path: Path, seconds: float = 3600.0) -> None:
    """As if made `seconds` ago: past the sweep's grace for a channel still starting."""
    then = time.time() - seconds
    os.utime(path, (then, then), follow_symlinks=False)


def _dead_pid() -> int:
    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait()  # reaped: no process has this pid now
    return finished.pid


def test_a_closed_channel_leaves_nothing():
    assert not _start_and_close().exists()


def test_a_sigkilled_process_directory_is_swept_at_the_next_start():
    """The reproduction of issue 59 item 7: a replica killed outright left its directory and socket for good."""
    child, left = _child_channel()
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert (left / SOCKET_NAME).exists()  # the kill ran no cleanup: the next start must find it
    _age(left)
    _start_and_close()
    assert not left.exists()


def test_a_live_process_keeps_its_directory_and_removes_it_at_exit():
    child, live = _child_channel()
    try:
        assert f"-{child.pid}-" in live.name  # the owner, named for the sweep
        _age(live)
        _start_and_close()
        assert live.exists()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.connect(str(live / SOCKET_NAME))  # still serving
    finally:
        child.stdin.close()  # the child exits with its channel still open
        assert child.wait(timeout=60) == 0
    assert not live.exists()


@pytest.fixture
def sweep_root():
    """A private directory to sweep (short: a socket path must stay under 104 bytes)."""
    root = Path(tempfile.mkdtemp(prefix="oc-sweep-"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _directory(root: Path, name: str, aged: bool = True) -> Path:
    path = root / name
    path.mkdir(mode=0o700)
    if aged:
        _age(path)
    return path


def _socket_in(directory: Path, listening: bool) -> socket.socket:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(directory / SOCKET_NAME))
    if listening:
        server.listen()
    else:
        server.close()  # the file stays, refusing connections: a dead server's socket
    _age(directory)  # the socket's creation touched the directory
    return server


def test_the_sweep_removes_only_dead_owners_directories_of_this_user(sweep_root):
    dead = _dead_pid()
    swept = [
        _directory(sweep_root, f"orchard-channel-{dead}-deadnone"),  # no socket yet, and never will
        _directory(sweep_root, "orchard-channel-oldrefus"),  # made before the pid was in the name
    ]
    _socket_in(swept[1], listening=False)
    kept = [
        _directory(sweep_root, f"orchard-channel-{os.getpid()}-livepid1"),
        _directory(sweep_root, f"orchard-channel-{dead}-young123", aged=False),  # maybe a channel still starting
        _directory(sweep_root, "orchard-channel-oldlisten"),
        _directory(sweep_root, f"orchard-channel-{dead}-listen12"),  # a live owner this process cannot see
        _directory(sweep_root, "unrelated"),
    ]
    listeners = [_socket_in(kept[2], listening=True), _socket_in(kept[3], listening=True)]
    target = _directory(sweep_root, "elsewhere")
    (target / "precious").write_text("kept")
    link = sweep_root / f"orchard-channel-{dead}-symlink1"
    link.symlink_to(target, target_is_directory=True)
    plain_file = sweep_root / f"orchard-channel-{dead}-plainfil"
    plain_file.write_text("")
    _age(plain_file)
    others = []
    if os.getuid() == 0:  # only root can give a directory to another user
        others.append(_directory(sweep_root, f"orchard-channel-{dead}-otheruid"))
        os.chown(others[0], 65534, 65534)
    try:
        removed = sweep_stale_socket_dirs(sweep_root, grace_s=SWEEP_GRACE_S)
    finally:
        for listener in listeners:
            listener.close()
    assert sorted(removed) == sorted(swept)
    assert not any(path.exists() for path in swept)
    assert all(path.exists() for path in [*kept, *others, plain_file])
    assert link.is_symlink() and (target / "precious").read_text() == "kept"
