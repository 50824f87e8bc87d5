"""Embedding throughput over HTTP: N single-sentence /v1/embeddings requests one at a time, then all N at once.

    scripts/loopback.sh python -m bench.embeddings_throughput [--requests 256 --repeat 3 --out result.json]
    python -m bench.embeddings_throughput --url http://127.0.0.1:8000      # a server already running

Without --url it starts Ray Serve on 127.0.0.1 with serve_config.yaml's ingress and embedding application only
(as `serve run` deploys them; --model-path points the embedder at another sentence-transformers folder). The
embedder's /v1/queue/stats row gives, per mode, its encode calls (engine_steps_total) and encode seconds
(engine_step_seconds_total): the wall time minus the encode time is what HTTP, Serve and the hand-offs cost.
Issue 28's acceptance: the concurrent round finishes >= 5x faster than the one-at-a-time round.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable

import aiohttp
import yaml

from bench.serving.orchard_server import (
    REPO,
    SHUTDOWN_TIMEOUT_S,
    _shutdown_serve,
    wait_running,
)

MODEL = "all-MiniLM-L6-v2"
TARGET_RATIO = 5.0
OBJECT_STORE_BYTES = 1 << 28  # the vectors are small


@dataclass
class EncodeCounters:
    """One read of the embedder's /v1/queue/stats row."""

    calls: int
    seconds: float
    process_cpu_s: float


@dataclass
class Round:
    mode: str  # "sequential" or "concurrent"
    requests: int
    wall_s: float
    requests_per_s: float
    encode_calls: int
    encode_s: float
    embedder_cpu_s: float
    overhead_ms_per_request: float  # (wall - encode) / requests: HTTP, proxy, ingress, handle, hand-offs
    cpu_s_by_process: dict[str, float]  # this client and the Ray it started (by process title)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="a running Orchard server; default: start the ingress and embedder here")
    p.add_argument("--api-key", help="sent as a Bearer token (a --url server with api_keys)")
    p.add_argument("--model", default=MODEL, help="the embedding model id")
    p.add_argument("--model-path", help="the embedder's model_path (default: serve_config.yaml's, default-embedding)")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--port", type=int, default=8000, help="where the started server listens")
    p.add_argument("--timeout-s", type=float, default=600.0, help="the most one round may take")
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    p.add_argument("--throughput-optimized", action="store_true",
                   help="the started Serve with RAY_SERVE_THROUGHPUT_OPTIMIZED=1 (less Ray cost per request)")
    p.add_argument("--encoding-format", choices=("base64", "float"), default="base64",
                   help="base64: what the openai client asks for unless told otherwise")
    p.add_argument("--out", help="write the results here as JSON")
    return p.parse_args(argv)


def sentences(count: int, round_index: int) -> list[str]:
    # Distinct texts of similar length (~21 tokens), different in every round.
    return [f"Request {round_index}-{i}: the quick brown fox jumps over the lazy dog near the river bank."
            for i in range(count)]


def graph_schema(model: str, model_path: str | None, state_dir: str) -> dict[str, Any]:
    """serve_config.yaml's ingress and its embedding application (the chat model left out)."""
    apps = yaml.safe_load((REPO / "serve_config.yaml").read_text())["applications"]
    ingress = copy.deepcopy(next(a for a in apps if "model_path" not in (a.get("args") or {})))
    embedder = copy.deepcopy(next(a for a in apps if (a.get("args") or {}).get("model_id") == model))
    ingress["args"].update(state_dir=state_dir, restore_models=False)
    if ingress["args"].get("rag"):  # the RAG deployment beside the ingress keeps its indexes here too
        ingress["args"]["rag"]["storage_dir"] = str(Path(state_dir) / "rag")
    if model_path:
        embedder["args"].update(model_path=str(Path(model_path).resolve()), model_type="embedding")
    return {"applications": [ingress, embedder]}


def process_cpu_seconds() -> dict[int, tuple[str, float]]:
    """CPU seconds so far of this client and of its child processes (the Ray it started: proxy, replicas, ...),
    by pid, with each one's title (ray::ProxyActor, ray::ServeReplica:APP:DEPLOYMENT); empty without psutil."""
    try:
        import psutil
    except ImportError:
        return {}
    me = psutil.Process()
    seconds = {}
    for proc in [me] + me.children(recursive=True):
        try:
            title = "client" if proc.pid == me.pid else Path(proc.cmdline()[0].split(" ")[0]).name.split(".")[0]
            times = proc.cpu_times()
        except (psutil.Error, IndexError):
            continue
        seconds[proc.pid] = (title, times.user + times.system)
    return seconds


def cpu_used(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds between two reads, by process title, largest first (titles under 10 ms left out)."""
    used: dict[str, float] = {}
    for pid, (title, seconds) in after.items():
        used[title] = used.get(title, 0.0) + seconds - before.get(pid, (title, 0.0))[1]
    return {title: round(s, 3) for title, s in sorted(used.items(), key=lambda kv: -kv[1]) if s >= 0.01}


async def encode_counters(http: aiohttp.ClientSession, model: str) -> EncodeCounters:
    async with http.get("/v1/queue/stats") as response:
        response.raise_for_status()
        row = next(r for r in (await response.json())["models"] if r["id"] == model)
    return EncodeCounters(row["engine_steps_total"], row["engine_step_seconds_total"],
                          row["process_cpu_seconds_total"])


async def embed_one(http: aiohttp.ClientSession, model: str, text: str, encoding: str) -> None:
    async with http.post("/v1/embeddings", json={"model": model, "input": text, "encoding_format": encoding}) as response:
        if response.status != 200:
            raise RuntimeError(f"/v1/embeddings answered {response.status}: {(await response.text())[:300]}")
        if len((await response.json())["data"]) != 1:
            raise RuntimeError("one input should give one vector")


async def timed_round(http: aiohttp.ClientSession, args: argparse.Namespace, texts: list[str],
                      concurrent: bool) -> Round:
    model, timeout_s = args.model, args.timeout_s
    before = await encode_counters(http, model)
    cpu_before = process_cpu_seconds()
    started = time.perf_counter()
    if concurrent:
        await asyncio.wait_for(asyncio.gather(*(embed_one(http, model, t, args.encoding_format) for t in texts)), timeout_s)
    else:
        async def one_at_a_time() -> None:
            for text in texts:
                await embed_one(http, model, text, args.encoding_format)
        await asyncio.wait_for(one_at_a_time(), timeout_s)
    wall = time.perf_counter() - started
    cpu_after = process_cpu_seconds()
    after = await encode_counters(http, model)
    encode_s = after.seconds - before.seconds
    return Round("concurrent" if concurrent else "sequential", len(texts), round(wall, 4),
                 round(len(texts) / wall, 1), after.calls - before.calls, round(encode_s, 4),
                 round(after.process_cpu_s - before.process_cpu_s, 3),
                 round((wall - encode_s) * 1000 / len(texts), 3),
                 cpu_used(cpu_before, cpu_after))


async def measure(base_url: str, args: argparse.Namespace) -> list[Round]:
    # aiohttp: httpx's client took ~8 ms of CPU a request here, on the cores the server needs.
    connector = aiohttp.TCPConnector(limit=args.requests)
    timeout = aiohttp.ClientTimeout(total=args.timeout_s)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    async with aiohttp.ClientSession(base_url, connector=connector, timeout=timeout, headers=headers) as http:
        # Warm-up: the first encodes build the model's kernels and every connection of the pool opens once.
        await timed_round(http, args, sentences(8, -1), False)
        await timed_round(http, args, sentences(args.requests, -2), True)
        rounds = []
        for index in range(args.repeat):
            for concurrent in (False, True):
                rounds.append(await timed_round(http, args, sentences(args.requests, index), concurrent))
                print(json.dumps(asdict(rounds[-1])), flush=True)
        return rounds


def summary(rounds: list[Round]) -> dict[str, Any]:
    by_mode = {mode: [r for r in rounds if r.mode == mode] for mode in ("sequential", "concurrent")}
    median = {mode: {field: statistics.median(getattr(r, field) for r in rs)
                     for field in ("wall_s", "requests_per_s", "encode_calls", "encode_s", "embedder_cpu_s",
                                   "overhead_ms_per_request")}
              for mode, rs in by_mode.items()}
    ratios = [s.wall_s / c.wall_s for s, c in zip(by_mode["sequential"], by_mode["concurrent"])]
    return {"median": median, "ratios": [round(r, 2) for r in ratios],
            "median_ratio": round(statistics.median(ratios), 2),
            "meets_target": statistics.median(ratios) >= TARGET_RATIO}


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"host": platform.node(), "python": platform.python_version()}
    try:
        import torch
        info.update(torch=torch.__version__, cuda=torch.cuda.is_available(), cpu_count=os.cpu_count(),
                    torch_threads=torch.get_num_threads())
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def with_started_graph(args: argparse.Namespace, run: Callable[[str], Awaitable[Any]] | None = None) -> Any:
    """Ray and Serve here, the ingress (with its RAG deployment) and the embedder deployed, `run(base_url)` (default:
    the rounds) run, then everything shut down. args: port, model, model_path, startup_timeout_s,
    throughput_optimized."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    if args.throughput_optimized:
        os.environ["RAY_SERVE_THROUGHPUT_OPTIMIZED"] = "1"
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(
        os.pathsep) if p])
    import ray
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    ray.init(num_cpus=os.cpu_count() or 2, include_dashboard=False, log_to_driver=False,
             object_store_memory=OBJECT_STORE_BYTES)
    try:
        with tempfile.TemporaryDirectory(prefix="orchard-embed-bench-") as state_dir:
            started = time.monotonic()
            serve.start(http_options={"host": "127.0.0.1", "port": args.port})
            schema = graph_schema(args.model, args.model_path, state_dir)
            _get_global_client().deploy_apps(ServeDeploySchema.model_validate(schema), _blocking=False)
            wait_running(args.startup_timeout_s, lambda: False)
            print(f"graph running in {time.monotonic() - started:.1f} s", flush=True)
            base_url = f"http://127.0.0.1:{args.port}"
            return asyncio.run(run(base_url) if run is not None else measure(base_url, args))
    finally:
        _shutdown_serve(SHUTDOWN_TIMEOUT_S)
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rounds = asyncio.run(measure(args.url, args)) if args.url else with_started_graph(args)
    result = {"benchmark": "embeddings_throughput", "model": args.model, "model_path": args.model_path,
              "encoding_format": args.encoding_format, "throughput_optimized": args.throughput_optimized,
              "requests": args.requests, "repeat": args.repeat, "machine": machine(),
              "rounds": [asdict(r) for r in rounds], **summary(rounds)}
    print(json.dumps({k: result[k] for k in ("median", "ratios", "median_ratio", "meets_target")}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
