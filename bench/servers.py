"""Servers under test as child processes: start, wait until they answer, stop (bounded at every step).

Each server runs in its own session (process group), so stopping it also ends the processes
it started (Ray's raylet and workers, mlx_lm.server's threads live in one process).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import httpx

from bench.serving_client import Target
from engine.backend import BACKEND_DEFAULTS
from engine.config import EngineConfig

SERVERS = ("orchard", "orchard_local", "mlx_lm")  # orchard_local: our HTTP stack without Ray


@dataclass
class ServerSpec:
    name: str
    argv: list[str]
    target: Target
    env: dict[str, str] = field(default_factory=dict)
    health_path: Optional[str] = None  # GET must answer 200 before the first probe request


@dataclass
class OrchardKnobs:
    decode_batch: int = 128
    prefill_batch: int = EngineConfig.max_prefill_seqs
    chunked_prefill_tokens: int = 2048
    context_length: Optional[int] = None
    throughput_optimized: bool = False
    prefix_cache: bool = True
    model_args: list[str] = field(default_factory=list)  # KEY=VALUE, more model entry fields


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def orchard_spec(model_path: str, model_id: str, port: int, knobs: OrchardKnobs, name: str = "orchard") -> ServerSpec:
    launcher = "bench.run_orchard_local" if name == "orchard_local" else "bench.run_orchard_server"
    argv = [sys.executable, "-m", launcher, "--model", model_path, "--model-id", model_id,
            "--port", str(port), "--decode-batch", str(knobs.decode_batch), "--prefill-batch", str(knobs.prefill_batch),
            "--chunked-prefill-tokens", str(knobs.chunked_prefill_tokens),
            "--max-num-seqs", str(max(512, 2 * knobs.decode_batch))]
    if knobs.context_length:
        argv += ["--context-length", str(knobs.context_length)]
    if knobs.throughput_optimized:
        argv.append("--throughput-optimized")
    if not knobs.prefix_cache:
        argv.append("--no-prefix-cache")
    for item in knobs.model_args:
        argv += ["--model-arg", item]
    target = Target(f"http://127.0.0.1:{port}", model_id, name, extra_body={"ignore_eos": True})
    return ServerSpec(name, argv, target, health_path="/health")


def mlx_lm_spec(model_path: str, port: int, decode_concurrency: int, prompt_concurrency: int) -> ServerSpec:
    argv = [sys.executable, "-m", "mlx_lm", "server", "--model", model_path, "--host", "127.0.0.1", "--port", str(port),
            "--decode-concurrency", str(decode_concurrency), "--prompt-concurrency", str(prompt_concurrency)]
    # "default_model" is the --model folder; any other name would be loaded as a path or Hub repo.
    # mlx_lm.server has no ignore_eos (it ignores unknown fields); random models rarely emit EOS.
    # The same MLX backend settings as our engine applies to itself, so the servers differ only in themselves.
    env = {name: os.environ.get(name, value) for name, value in BACKEND_DEFAULTS.items()}
    return ServerSpec("mlx_lm", argv, Target(f"http://127.0.0.1:{port}", "default_model", "mlx_lm"), env=env)


class ServerProcess:
    """A server child process with its output in `log_path`."""

    def __init__(self, spec: ServerSpec, log_path: Path, cwd: Path) -> None:
        self.spec = spec
        self.log_path = log_path
        self.cwd = cwd
        self.proc: Optional[subprocess.Popen] = None
        self.started_at = 0.0
        self.ready_s: Optional[float] = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.spec.env, "PYTHONUNBUFFERED": "1"}
        paths = [str(self.cwd)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.spec.argv, stdout=log, stderr=subprocess.STDOUT, cwd=self.cwd,
                                         env=env, start_new_session=True)
        self.started_at = time.monotonic()

    def wait_ready(self, timeout_s: float) -> float:
        """Poll (health, then a 1-token request) until the server answers; seconds from start. Raises on failure."""
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=30.0) as http:
            while True:
                self._check_alive()
                if self._probe(http):
                    self.ready_s = time.monotonic() - self.started_at
                    return self.ready_s
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.spec.name} not ready after {timeout_s:.0f} s\n{self.log_tail()}")
                time.sleep(1.0)

    def _probe(self, http: httpx.Client) -> bool:
        target = self.spec.target
        try:
            if self.spec.health_path and http.get(target.base_url + self.spec.health_path).status_code != 200:
                return False
            body: dict[str, Any] = {"model": target.model, "max_tokens": 1,
                                    "messages": [{"role": "user", "content": "t1 t2 t3"}], **target.extra_body}
            return http.post(target.base_url + "/v1/chat/completions", json=body).status_code == 200
        except httpx.HTTPError:
            return False

    def _check_alive(self) -> None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.spec.name} exited with {self.proc.returncode}\n{self.log_tail()}")

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGINT (graceful: Serve and Ray shut down), then SIGTERM, then SIGKILL to the whole process group."""
        if self.proc is None:
            return
        for sig, wait_s in ((signal.SIGINT, timeout_s), (signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
            if self.proc.poll() is not None:
                break
            self._signal(self.proc.pid, sig)
            try:
                self.proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                continue
        # Whatever the server left in its own group (Ray's raylet, GCS, workers) goes too.
        self._signal_group(signal.SIGTERM)
        time.sleep(1.0)
        self._signal_group(signal.SIGKILL)

    @staticmethod
    def _signal(pid: int, sig: int) -> None:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass

    def _signal_group(self, sig: int) -> None:
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, sig)  # the group we created with start_new_session
        except (ProcessLookupError, PermissionError):
            pass

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""
