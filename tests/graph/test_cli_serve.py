"""`orchard serve` and `orchard doctor` as a user runs them (subprocesses). One test starts the real thing (Ray,
Serve, a tiny model: ~30 s) and stops it with Ctrl-C; the others fail before Ray starts."""

from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import yaml

from tests.graph.conftest import GRAPH_START_S, TEST_RAY_ENV
from tests.support.serving import free_port

REPO = Path(__file__).resolve().parents[2]
ORCHARD = [sys.executable, "-m", "deployments.cli.main"]


def orchard(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*ORCHARD, *args], capture_output=True, text=True, cwd=REPO, env=env or dict(os.environ),
                          timeout=120, check=False)


def write_config(folder: Path, port: int, model_path: Path) -> Path:
    config = {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [
            {"name": "orchard", "route_prefix": "/", "import_path": "deployments.app:build_app",
             "args": {"restore_models": False, "rag": None, "state_dir": str(folder / "state"),
                      "ray_actor_options": {"num_cpus": 0.1}}},
            {"name": "tiny", "route_prefix": None, "import_path": "deployments.app:build_app",
             "args": {"model_id": "tiny", "model_path": str(model_path), "ray_actor_options": {"num_cpus": 0.1}}},
        ],
    }
    path = folder / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


class Lines:
    """A child's output lines as they come, read on a thread so a hung child fails the test instead of hanging it."""

    def __init__(self, stream) -> None:
        self.seen: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream) -> None:
        for line in iter(stream.readline, ""):
            self._queue.put(line)
        self._queue.put(None)

    def until(self, text: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while not any(text in line for line in self.seen):
            try:
                line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {text!r} within {timeout_s} s; output:\n{''.join(self.seen)}") from None
            assert line is not None, f"exited before {text!r}; output:\n{''.join(self.seen)}"
            self.seen.append(line)
        return "".join(self.seen)


def descendants(root: int) -> dict[int, str]:
    """Every process below `root` (serve run, Ray's GCS, raylet, dashboard, workers...): pid -> command line."""
    parents, commands = {}, {}
    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            commands[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        parents[pid] = int(stat.rsplit(")", 1)[1].split()[1])
    below, frontier = {}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, ppid in parents.items():
            if ppid == parent and pid not in below:
                below[pid] = commands[pid]
                frontier.append(pid)
    return below


def alive(pids) -> list[int]:
    return [pid for pid in pids if Path(f"/proc/{pid}").exists() and "(Z)" not in _state(pid)]


def niceness(pids) -> dict[int, int]:
    """pid -> nice value (field 19 of /proc/<pid>/stat) of those still there."""
    nice = {}
    for pid in pids:
        try:
            nice[pid] = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16])
        except OSError:
            continue
    return nice


def _state(pid: int) -> str:
    try:
        return "(" + Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] + ")"
    except OSError:
        return "(gone)"


def test_serve_prints_its_banner_once_healthy_and_stops_cleanly_on_ctrl_c(tiny_models, tmp_path):
    port = free_port()
    config = write_config(tmp_path, port, tiny_models.alpha)
    home = tmp_path / "home"
    env = {**os.environ, **TEST_RAY_ENV, "ORCHARD_HOME": str(home)}
    for variable in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_worker_niceness"):  # orchard serve sets them
        env.pop(variable, None)
    child = subprocess.Popen([*ORCHARD, "serve", str(config)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, cwd=REPO, env=env)
    output = Lines(child.stdout)
    try:
        banner = output.until("Ctrl-C stops it.", GRAPH_START_S)
        assert banner.startswith(f"starting Ray Serve with {config} (Ray's log: {home}/logs/serve.log) ...\n")
        assert re.search(r"^  \[ *\d+ s\] starting Ray \.\.\.$", banner, re.MULTILINE), banner
        assert re.search(r"^  \[ *\d+ s\] Ray is up; Serve is deploying the applications \.\.\.$", banner, re.MULTILINE)
        assert f"    API:       http://127.0.0.1:{port}/v1  (OpenAI and Anthropic routes; /health, /docs)\n" in banner
        assert "    models:    tiny (lm, running)\n" in banner
        assert re.search(r"^    dashboard: http://127\.0\.0\.1:\d+$", banner, re.MULTILINE), banner
        assert "RAY_AUTH_MODE=token serve status" in banner
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
        assert health.status_code == 200 and health.json()["status"] == "ok"
        started = descendants(child.pid)
        assert any("gcs_server" in command for command in started.values()), started  # its own Ray
        workers = [pid for pid, command in started.items() if command.startswith("ray::")]  # Ray's process titles
        assert any("ServeReplica:tiny" in started[pid] for pid in workers), started
        # Ray's default would be our niceness + 15; RAY_worker_niceness=0 leaves the workers at ours
        assert set(niceness(workers).values()) == {os.getpriority(os.PRIO_PROCESS, 0)}, niceness(workers)
        child.send_signal(signal.SIGINT)
        assert child.wait(timeout=120) == 0
    finally:
        if child.poll() is None:
            child.kill()
    assert output.until("stopped.", 5).endswith("stopping: shutting Serve and the Ray it started down ...\nstopped.\n")
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", port)) != 0  # nothing serves the port any more
    deadline = time.monotonic() + 30  # Ray's workers exit on their own schedule once their raylet is gone
    while (left := alive(started)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left == [], {pid: started[pid] for pid in left}


def test_serve_refuses_a_taken_port_and_a_missing_config_before_starting_ray(tiny_models, tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        config = write_config(tmp_path, port, tiny_models.alpha)
        result = orchard("serve", str(config))
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr == (f"orchard serve: 127.0.0.1:{port} is in use: is a server already running? "
                             "(stop it, or set http_options.port in serve_config.yaml)\n")
    missing = orchard("serve", str(tmp_path / "nope.yaml"))
    assert missing.returncode == 1
    assert missing.stderr == (f"orchard serve: no config file {tmp_path / 'nope.yaml'} "
                              "(run from the repository's root, or name one)\n")


def test_doctor_passes_here_and_fails_naming_the_fix_when_port_8000_is_taken():
    result = orchard("doctor")
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"^  ok  mlx: MLX [\d.]+, device \w+, [\d.]+ GiB memory$", result.stdout, re.MULTILINE)
    assert re.search(r"^  ok  ray: Ray [\d.]+ with Serve$", result.stdout, re.MULTILINE)
    assert "all checks passed." in result.stdout
    with socket.create_server(("127.0.0.1", 8000)):  # scripts/test.sh's namespace: nobody else's 8000
        taken = orchard("doctor")
    assert taken.returncode == 1
    assert "FAIL  port 8000: in use (Orchard's HTTP port (serve_config.yaml))\n" in taken.stdout
    assert "      fix: stop what listens on it" in taken.stdout and taken.stdout.endswith("\n1 check(s) failed.\n")
