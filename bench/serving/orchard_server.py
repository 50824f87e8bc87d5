"""Start our server on one model folder: Ray + Serve on 127.0.0.1:PORT, the applications serve_config.yaml declares.

    python -m bench.serving.orchard_server --model PATH --port 8000 [--decode-batch 128 ...] \
        [--model-arg KEY=VALUE ...]     # KEY may be dotted: advanced.prefill_warmup_seconds=15
        [--with-config-models]          # serve_config.yaml's own models too, as written (bench.soak)

The ingress and model entries are serve_config.yaml's own, deployed the way `serve run` does
(a ServeDeploySchema), with the model entry pointed at PATH and sized for the benchmark
(128 streams, no 429s). Prints "ORCHARD READY" once every application runs; blocks until
SIGINT / SIGTERM, then shuts Serve and Ray down. Exits non-zero if a deployment fails.
Where `serve` is not on PATH (the GPU bundle), this is the way to start the graph.

bench.serving.compare starts it as a child process. This module is the serving package's only
door to deployments/ and engine/ (serve_app_name, the engine's MLX backend settings).
"""

from __future__ import annotations

import argparse
import copy
import ipaddress
import os
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional
from urllib.parse import urlparse

import yaml

REPO = Path(__file__).resolve().parents[2]
READY_LINE = "ORCHARD READY"
SHUTDOWN_TIMEOUT_S = 8.0  # then ray.shutdown() ends every actor anyway
OBJECT_STORE_BYTES = 1 << 30


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="mlx-lm model folder")
    p.add_argument("--model-id", help="default: the folder's name")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-num-seqs", type=int, default=512, help="max_num_seqs")
    p.add_argument("--decode-batch", type=int, default=128, help="max_decode_seqs")
    p.add_argument("--prefill-batch", type=int, default=None, help="max_prefill_seqs (default: the model entry's)")
    p.add_argument("--chunked-prefill-tokens", type=int, default=2048, help="prefill_chunk_tokens")
    p.add_argument("--queue-size", type=int, default=512)
    p.add_argument("--context-length", type=int, default=None, help="default: the model's own")
    p.add_argument("--no-prefix-cache", action="store_true")
    p.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="any other model entry field (YAML value), e.g. max_ongoing_requests=1024; a dotted KEY "
                        "sets a nested field, e.g. advanced.prefill_warmup_seconds=15")
    p.add_argument("--with-config-models", action="store_true",
                   help="also serve serve_config.yaml's own model applications as they are (the embedded SmolLM2)")
    p.add_argument("--num-cpus", type=int, default=os.cpu_count() or 2, help="Ray's logical CPUs")
    p.add_argument("--throughput-optimized", action="store_true", help="RAY_SERVE_THROUGHPUT_OPTIMIZED=1")
    p.add_argument("--dashboard", action="store_true", help="Ray's dashboard on 127.0.0.1:8265 (scripts/ops_screenshots.sh)")
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    return p.parse_args(argv)


def model_entry_args(args: argparse.Namespace, model_id: str) -> dict[str, Any]:
    """The model entry's fields this launcher sets (--model-arg fields are applied after them)."""
    entry = {
        "model_id": model_id,
        "model_path": str(Path(args.model).resolve()),
        "max_num_seqs": args.max_num_seqs,
        "max_decode_seqs": args.decode_batch,
        "prefill_chunk_tokens": args.chunked_prefill_tokens,
        "enable_prefix_cache": not args.no_prefix_cache,
        "queue_size": args.queue_size,
    }
    if args.prefill_batch:
        entry["max_prefill_seqs"] = args.prefill_batch
    if args.context_length:
        entry["context_length"] = args.context_length
    return entry


def parse_fields(items: list[str]) -> list[tuple[list[str], Any]]:
    """KEY=VALUE items as (key path, YAML value); a dotted KEY names a field of a nested mapping."""
    fields = []
    for item in items:
        key, sep, value = item.partition("=")
        path = [part.strip() for part in key.split(".")]
        if not sep or not all(path):
            raise SystemExit(f"--model-arg wants KEY=VALUE (KEY may be dotted: advanced.NAME), got {item!r}")
        fields.append((path, yaml.safe_load(value)))
    return fields


def set_field(entry: dict[str, Any], path: list[str], value: Any) -> None:
    """entry[a][b]... = value, creating the nested mappings a dotted key needs (others they hold are kept)."""
    node = entry
    for part in path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise SystemExit(f"--model-arg {'.'.join(path)}: {part!r} is not a mapping in the model entry")
        node = child
    node[path[-1]] = value


def config_applications() -> tuple[dict[str, Any], dict[str, Any]]:
    """serve_config.yaml's ingress application and its (first) model application."""
    apps = yaml.safe_load((REPO / "serve_config.yaml").read_text())["applications"]
    ingress = next(a for a in apps if "model_path" not in (a.get("args") or {}))
    template = next(a for a in apps if "model_path" in (a.get("args") or {}))
    return copy.deepcopy(ingress), copy.deepcopy(template)


def config_model_applications() -> list[dict[str, Any]]:
    """serve_config.yaml's model applications as written."""
    apps = yaml.safe_load((REPO / "serve_config.yaml").read_text())["applications"]
    return [a for a in apps if "model_path" in (a.get("args") or {})]


def deploy_schema(args: argparse.Namespace, model_id: str, state_dir: str) -> dict[str, Any]:
    """serve_config.yaml with its model entry copied onto our model (same builder, same fields); with
    --with-config-models, the config's own models come too."""
    from deployments.config import serve_app_name

    ingress, model = config_applications()
    # A private state dir and no restore: models loaded through the admin API elsewhere must not come along.
    ingress["args"].update(state_dir=state_dir, restore_models=False)
    model["name"] = serve_app_name(model_id)
    model["args"].update(model_entry_args(args, model_id))
    for path, value in parse_fields(args.model_arg):
        set_field(model["args"], path, value)
    extra = config_model_applications() if args.with_config_models else []
    return {"applications": [ingress, model] + [a for a in extra if a["name"] != model["name"]]}


def mlx_backend_env() -> dict[str, str]:
    """The MLX backend settings our engine applies to itself (the environment's own values win): compare gives
    mlx_lm.server the same, so that the servers differ only in themselves."""
    from engine.mlx_settings import MLX_SETTINGS

    return {name: os.environ.get(name, value) for name, value in MLX_SETTINGS.items()}


def wait_running(timeout_s: float, stopped: Callable[[], bool]) -> None:
    """Until every application runs; raises with Serve's message if one fails (or on a stop signal)."""
    from ray import serve
    from ray.serve.schema import ApplicationStatus

    deadline = time.monotonic() + timeout_s
    while True:
        apps = serve.status().applications
        failed = {n: a.message for n, a in apps.items()
                  if a.status in (ApplicationStatus.DEPLOY_FAILED, ApplicationStatus.UNHEALTHY)}
        if failed:
            raise RuntimeError(f"deployment failed: {failed}")
        if apps and all(a.status == ApplicationStatus.RUNNING for a in apps.values()):
            return
        if stopped():
            raise InterruptedError("stopped before the applications were running")
        if time.monotonic() > deadline:
            raise TimeoutError(f"applications not running after {timeout_s} s: { {n: a.status for n, a in apps.items()} }")
        time.sleep(0.5)


def _shutdown_serve(timeout_s: float) -> None:
    """serve.shutdown() with a shorter wait: direct ingress (RAY_SERVE_THROUGHPUT_OPTIMIZED) drains for ~30 s."""
    from ray import serve
    from ray.serve.context import _get_global_client, _set_global_client

    try:
        _get_global_client().shutdown(timeout_s=timeout_s)
        _set_global_client(None)
    except Exception:  # no Serve running, or a private API that moved: the public call
        serve.shutdown()


def _set_environment(args: argparse.Namespace) -> None:
    # Ray's workers inherit this environment: they must import deployments/ and engine/ from this tree.
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if str(REPO) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in paths if p])
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Ray's node IP 127.0.0.1, hence every Ray process on loopback (read at `import ray`), as the README's server.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    if args.throughput_optimized:
        os.environ["RAY_SERVE_THROUGHPUT_OPTIMIZED"] = "1"
    sys.path.insert(0, str(REPO))


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    _set_environment(args)
    import ray
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    model_id = args.model_id or Path(args.model).resolve().name
    stop = {"now": False}
    started = time.monotonic()
    # Stream chunks are tiny: a small object store spares /dev/shm (Ray would reserve 30% of RAM).
    ray.init(num_cpus=args.num_cpus, include_dashboard=args.dashboard, dashboard_host="127.0.0.1", log_to_driver=False,
             object_store_memory=OBJECT_STORE_BYTES)
    for sig in (signal.SIGINT, signal.SIGTERM):  # after ray.init, which installs its own handlers
        signal.signal(sig, lambda *_: stop.update(now=True))
    code = 0
    try:
        with tempfile.TemporaryDirectory(prefix="orchard-bench-state-") as state_dir:
            serve.start(http_options={"host": "127.0.0.1", "port": args.port})
            schema = ServeDeploySchema.model_validate(deploy_schema(args, model_id, state_dir))
            _get_global_client().deploy_apps(schema, _blocking=False)  # what `serve run serve_config.yaml` does
            wait_running(args.startup_timeout_s, lambda: stop["now"])
            print(f"{READY_LINE} model_id={model_id} port={args.port} in {time.monotonic() - started:.1f} s", flush=True)
            while not stop["now"]:
                time.sleep(0.2)
    except Exception as exc:  # reported to the parent through the log; the exit code says it failed
        print(f"orchard server failed: {type(exc).__name__}: {exc}", flush=True)
        code = 2
    finally:
        _shutdown_serve(SHUTDOWN_TIMEOUT_S)
        ray.shutdown()
        print("orchard server stopped", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())


# ---- where a server under load is (bench.soak)
def check_loopback(url: str, allow_remote: bool) -> str:
    host = urlparse(url).hostname
    if not host:
        print(f"--url {url!r}: no host", file=sys.stderr)
        raise SystemExit(2)
    addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    if not allow_remote and not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses):
        print(f"--url {url!r} resolves to {sorted(addresses)}, beyond loopback: a load test there needs "
              "--allow-remote (and the owner's consent)", file=sys.stderr)
        raise SystemExit(2)
    return url.rstrip("/")


def in_loopback_namespace() -> bool:
    return [name for _, name in socket.if_nameindex()] == ["lo"]


def serve_log_errors(server_pid: int, keep: int = 10) -> dict[str, Any]:
    """ERROR lines and tracebacks in the Ray Serve logs of the server we started (its session is named after
    its pid): the soak reports them; they do not fail it."""
    lines = []
    for path in sorted((Path(tempfile.gettempdir()) / "ray").glob(f"session_*_{server_pid}/logs/serve/*.log")):
        lines += [f"{path.name}: {line}" for line in path.read_text(errors="replace").splitlines()
                  if line.startswith(("ERROR", "Traceback"))]
    errors = [line for line in lines if ": ERROR" in line]
    return {"error_lines": len(errors), "tracebacks": len(lines) - len(errors), "first": errors[:keep]}
