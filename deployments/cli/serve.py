"""`orchard serve [serve_config.yaml]`: Ray's own `serve run` in a child process, with Ray kept on loopback, a
banner once /ready says every model runs, progress while it waits, and a clean Ctrl-C.

Loopback: Ray picks its node address (and with it where GCS, raylet, workers, agents and metrics listen) at
`import ray`, from RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER (ray/_private/ray_constants.py; services.get_node_ip_address
answers 127.0.0.1 when it is 0, the host's address otherwise on Linux). We set it to 0 for the child, so every Ray
socket is on loopback (each replica's gRPC server through deployments/ray_loopback.py) and no network namespace is
needed: a client in another terminal reaches the server on 127.0.0.1."""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from deployments.cli.bodega_config import is_bodega_config, serve_config_of
from deployments.cli.server_client import (
    ServerError, forget_server_url, orchard_home, record_server_url, served_models, server_health, server_readiness,
)

DEFAULT_CONFIG = "serve_config.yaml"
DASHBOARD_LINE = re.compile(r"View the dashboard at (\S+)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
SHUTDOWN_TIMEOUT_S = 60.0


def add_parser(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser("serve", help="run the server of serve_config.yaml (Ray Serve), Ctrl-C stops it")
    serve.add_argument("config", nargs="?", default=DEFAULT_CONFIG, help=f"Serve config, or a Bodega config.yaml (server + models) (default: {DEFAULT_CONFIG})")
    serve.add_argument("--verbose", action="store_true",
                       help="show Ray's log in the terminal, not only in the log file")
    serve.add_argument("--address", default="local", help="Ray to use (default: a new local Ray, stopped with the "
                       "server; `auto`: a running cluster, left running)")
    serve.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for /ready before giving up")
    serve.add_argument("--port", type=int, default=None, help="the HTTP port (default: the config's "
                       "http_options.port; 44468 answers clients written for Bodega); orchard chat/top/bench find it")


@dataclass
class ServeTarget:
    config_path: Path  # as named; run_path is what `serve run` reads (a copy on another --port)
    host: str
    port: int
    url: str
    run_path: Path


@dataclass
class ChildOutput:
    """serve run's output, copied to the log file (and the terminal with --verbose) by a reader thread."""

    log_path: Path
    verbose: bool
    dashboard_url: str | None = None
    ray_started: bool = False
    tail: list[str] = field(default_factory=list)

    def pump(self, stream) -> None:
        with open(self.log_path, "w") as log:
            for line in iter(stream.readline, ""):
                log.write(line)
                log.flush()
                self.tail = (self.tail + [line])[-40:]
                self.ray_started = self.ray_started or "Started a local Ray instance" in line
                found = DASHBOARD_LINE.search(ANSI.sub("", line))
                if found and self.dashboard_url is None:
                    self.dashboard_url = found.group(1).rstrip(".")
                if self.verbose:
                    sys.stderr.write(line)


def _interrupt(_signum, _frame) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    # Started in the background of a script, SIGINT arrives ignored; `kill` (SIGTERM) stops it as cleanly as Ctrl-C.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        target = _read_target(Path(args.config), args.port)
        _check_port_free(target)
    except ServerError as exc:
        print(f"orchard serve: {exc}", file=sys.stderr)
        return 1
    output = ChildOutput(_log_path(), args.verbose)
    child = subprocess.Popen(
        [sys.executable, "-m", "ray.serve.scripts", "run", "--address", args.address, str(target.run_path)],
        env=_child_env(),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
        start_new_session=True,  # Ctrl-C reaches us only; we hand it to serve run, which then shuts Serve down
    )
    threading.Thread(target=output.pump, args=(child.stdout,), daemon=True).start()
    print(f"starting Ray Serve with {target.config_path} (Ray's log: {output.log_path}) ...", flush=True)
    try:
        if not _wait_healthy(child, target, output, args.timeout):
            _stop(child)
            return 1
        record_server_url(target.url)
        child.wait()  # until Ctrl-C
        print(f"orchard serve: serve run exited with {child.returncode}; its log: {output.log_path}", file=sys.stderr)
        print("".join(output.tail[-20:]), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nstopping: shutting Serve and the Ray it started down ...", flush=True)
        return 0 if _stop(child) else 1
    finally:
        forget_server_url(target.url)


def _read_target(config_path: Path, port: int | None = None) -> ServeTarget:
    """Where the config serves; with `port`, a copy of the config that serves there (its relative paths resolve
    from the working directory, as the original's do, so the copy may live elsewhere). A Bodega config.yaml runs as
    the Serve config it translates to (cli/bodega_config.py)."""
    if not config_path.is_file():
        raise ServerError(f"no config file {config_path} (run from the repository's root, or name one)")
    try:
        config = yaml.safe_load(config_path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ServerError(f"{config_path} is not valid YAML: {exc}") from exc
    bodega = is_bodega_config(config)
    if bodega:  # Bodega's config.yaml: the Serve config that serves its models
        config = serve_config_of(config)
    http = config.get("http_options") or {}
    host = str(http.get("host", "127.0.0.1"))
    run_path = config_path.resolve()
    if port is not None and not 0 < port < 65536:
        raise ServerError(f"--port {port} is not a TCP port")
    if port is not None or bodega:
        config["http_options"] = {**http, "port": port if port is not None else http.get("port", 8000)}
        run_path = orchard_home() / "run" / f"{config_path.stem}.port-{config['http_options']['port']}.yaml"
        run_path.parent.mkdir(parents=True, exist_ok=True)
        run_path.write_text(yaml.safe_dump(config, sort_keys=False))
    port = int(port if port is not None else http.get("port", 8000))
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    return ServeTarget(config_path.resolve(), host, port, f"http://{shown}:{port}", run_path)


def _check_port_free(target: ServeTarget) -> None:
    with socket.socket() as probe:
        probe.settimeout(1)
        if probe.connect_ex(("127.0.0.1" if target.host in ("0.0.0.0", "::") else target.host, target.port)) == 0:
            raise ServerError(f"{target.host}:{target.port} is in use: is a server already running? "
                              f"(stop it, or set http_options.port in {target.config_path.name})")


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray on loopback (module docstring)
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Ray starts workers, and so each model's engine process, at nice 15; unprivileged, they cannot come back down
    env.setdefault("RAY_worker_niceness", "0")
    env["PYTHONUNBUFFERED"] = "1"  # the dashboard line and errors arrive as they happen
    return env


def _log_path() -> Path:
    folder = orchard_home() / "logs"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / "serve.log"


def _wait_healthy(child: subprocess.Popen, target: ServeTarget, output: ChildOutput, timeout_s: float) -> bool:
    started, said = time.monotonic(), ""
    while time.monotonic() - started < timeout_s:
        if child.poll() is not None:
            print(f"orchard serve: serve run exited with {child.returncode} before the server was ready:\n"
                  + "".join(output.tail[-20:]), file=sys.stderr)
            return False
        progress, healthy = _progress(target, output.ray_started)
        if healthy is not None:
            _print_banner(target, healthy, output.dashboard_url, time.monotonic() - started)
            return True
        if progress != said:
            print(f"  [{time.monotonic() - started:4.0f} s] {progress}", flush=True)
            said = progress
        time.sleep(1.0)
    print(f"orchard serve: not ready after {timeout_s:.0f} s; Ray's log: {output.log_path}", file=sys.stderr)
    return False


def _progress(target: ServeTarget, ray_started: bool) -> tuple[str, dict | None]:
    """What the server is doing, and /health's body once /ready says no model is still loading and some model runs
    (every one, or all but those that failed: they show in the banner)."""
    try:
        readiness = server_readiness(target.url, timeout_s=2.0)
        settled = not readiness["loading"] and bool(readiness["running"])
        health = server_health(target.url, timeout_s=2.0) if settled else None
    except ServerError:  # /ready answers once Serve's proxy and the ingress run
        return ("Ray is up; Serve is deploying the applications ..." if ray_started else "starting Ray ..."), None
    if health is not None:
        return "", health
    states = ", ".join([f"{m} loading" for m in readiness["loading"]] + [f"{m} failed" for m in readiness["failed"]])
    return f"loading models: {states or 'no model yet'}", None


def _print_banner(target: ServeTarget, health: dict, dashboard_url: str | None, waited_s: float) -> None:
    models = "\n".join(f"               {m.id} ({m.type}, {m.status})" for m in served_models(health)).lstrip()
    print(f"""
  Orchard is ready after {waited_s:.0f} s ({health['status']}).
    API:       {target.url}/v1  (OpenAI and Anthropic routes; /health, /docs)
    models:    {models}
    dashboard: {dashboard_url or "not running (install ray[default] for it)"}
    chat:      orchard chat           (in another terminal)
    status:    RAY_AUTH_MODE=token serve status   (Ray 2.60 CLIs need the token mode; the token is ~/.ray/auth_token)
  Ctrl-C stops it.
""", flush=True)


def _stop(child: subprocess.Popen) -> bool:
    """SIGINT is `serve run`'s graceful path (serve.shutdown, then the Ray it started exits with it)."""
    if child.poll() is None:
        child.send_signal(signal.SIGINT)
    try:
        child.wait(timeout=SHUTDOWN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        print(f"serve run did not stop within {SHUTDOWN_TIMEOUT_S:.0f} s: terminating it", file=sys.stderr)
        os.killpg(child.pid, signal.SIGTERM)
        child.wait(timeout=10)
        return False
    print("stopped.", flush=True)
    return True
