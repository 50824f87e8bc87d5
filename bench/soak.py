"""Soak test: N mixed requests at C concurrency with client disconnects; every answer checked; the server must
end idle (running, waiting, KV back to their baseline).

    scripts/loopback.sh python -m bench.soak --start --requests 3000 --concurrency 48 --disconnect-fraction 0.1 \
        --smol-fraction 0.05 --out /tmp/soak.json          # starts a server: a tiny random model + SmolLM2
    python -m bench.soak --url http://127.0.0.1:8000 --model ID [--smol-model ID] ...   # a running server

The mix: OpenAI chat completions and completions, Anthropic messages, streamed or not, random small max_tokens
and temperatures, some stop strings; JSON-schema output on some SmolLM2 chat requests. --disconnect-fraction of
the requests are streams the client closes after a random number of events (or before the first). Checks:
bench/serving/answers.py. Exit code 1 on any 5xx, hung request, stream error, wrong answer, unexpected 4xx,
connection error, an unhealthy server at the end, or a server that does not return to idle (a leak); 2 when
the run could not start. 429s (with Retry-After and the API's error body) are counted as overload, not failures.
--hostile-fraction adds that share of hostile requests (issues 48 and 59: grammar bombs, unknown models, traversal,
resources no node has, 30 MB prompts, 7 MB echoed ids, ...) at
seeded places among the same normal ones: each must be refused with its expected 4xx, none may hang, and no engine
process may die; run it with and without to compare the normal requests' latency.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from bench.serving.answers import Answer, Cut, Shape, send
from bench.serving.compare import (
    OrchardKnobs,
    ServerProcess,
    build_model,
    free_port,
    git_commit,
    orchard_spec,
)
from bench.serving.orchard_server import check_loopback, in_loopback_namespace, serve_log_errors
from bench.serving.reports import (
    asdict_map, read_engines, read_health, read_state, settle, summarize, table, verdict,
)
from deployments.cli.loadgen.client import random_words
from deployments.cli.loadgen.load import run_async, write_json
from deployments.cli.loadgen.tables import show

REPO = Path(__file__).resolve().parents[1]
TINY_ID = "soak-tiny"
SMOL_ID = "SmolLM2-135M-Instruct"  # serve_config.yaml's embedded default model
TINY_VOCAB = 512  # tests.support.random_model's tiny shape
SMOL_PROMPTS = ("Name a color.", "What is {a} plus {b}?", "Say hello to {name}.", "Count to {a}.",
                "Give one word for the number {a}.", "Is {a} bigger than {b}? Answer yes or no.")
NAMES = ("Ada", "Grace", "Alan", "Edsger", "Barbara")
SMOL_STOPS = (".", "\n", ",", " the", "!")


@dataclass
class Mix:
    """How the requests are drawn (all seeded)."""

    requests: int
    disconnect_fraction: float
    smol_fraction: float
    stream_fraction: float
    stop_fraction: float
    json_fraction: float  # of SmolLM2 chat requests
    max_tokens: int
    smol_max_tokens: int
    max_prompt_words: int
    seed: int


# ---- the hostile mix (issue 48): requests the server must refuse at once, among the normal ones
PIXEL = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
HOSTILE_BOUND_S = 2.0  # the issue's bound on a refusal


@dataclass(frozen=True)
class Hostile:
    name: str
    method: str
    path: str
    body: dict[str, Any] | None
    expect: tuple[int, ...]  # the statuses that refuse it rightly


@dataclass
class HostileAnswer:
    name: str
    status: int | None  # None: hung or the connection failed
    seconds: float
    refused: bool  # with an expected status


def hostile_catalog(tiny: str, smol: str | None) -> list[Hostile]:
    def chat(**extra: Any) -> dict[str, Any]:
        return {"model": tiny, "messages": [{"role": "user", "content": "t1 t2"}], "max_tokens": 4, **extra}

    return [*_issue48_catalog(tiny, chat), *_issue59_catalog(tiny, smol or tiny)]


def _issue48_catalog(tiny: str, chat: Any) -> list[Hostile]:

    def schema(value: dict[str, Any]) -> dict[str, Any]:
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "e", "schema": value}}}

    image = [{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": PIXEL}}]
    return [
        Hostile("string schema of 10M characters", "POST", "/v1/chat/completions",
                chat(**schema({"type": "string", "minLength": 10_000_000, "maxLength": 100_000_000})), (400,)),
        Hostile("array schema of 1M items", "POST", "/v1/chat/completions", chat(**schema(
            {"type": "array", "items": {"type": "string"}, "minItems": 1_000_000, "maxItems": 10_000_000})), (400,)),
        Hostile("regex of 1M positions", "POST", "/v1/chat/completions", chat(guided_regex="((a{100}){100}){100}"),
                (400,)),
        Hostile("unknown model with an image", "POST", "/v1/chat/completions",
                {"model": "no-such-model", "messages": [{"role": "user", "content": image}]}, (404,)),
        Hostile("unknown model (Anthropic)", "POST", "/v1/messages",
                {"model": "no-such-model", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}, (404,)),
        Hostile("remote image on loopback", "POST", "/v1/chat/completions", chat(messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}}]}]),
                (400,)),
        Hostile("admin load of a folder with no config.json", "POST", "/v1/admin/load-model",
                {"model_path": "/tmp", "model_id": "hostile"}, (400, 401, 403)),
        Hostile("cache delete with encoded dots", "DELETE", "/v1/models/local/..%2F..%2Fetc", None,
                (400, 401, 403, 404)),
        Hostile("unknown stored response", "GET", "/v1/responses/resp_none", None, (404,)),
    ]


def _issue59_catalog(tiny: str, big: str) -> list[Hostile]:
    """Issue 59's: resources no node has, prompts of ~30 MB (on `big`, a model with a real tokenizer: SmolLM2's),
    7 MB echoed ids."""
    huge = "w " * 15_500_000
    many = [{"role": "user" if i % 2 == 0 else "assistant", "content": "word " * 600} for i in range(10_001)]
    seven_mb = "u" * 7_000_000
    return [
        Hostile("admin load asking 1000 CPUs", "POST", "/v1/admin/load-model",
                {"model_id": "greedy", "model_path": "default", "ray_actor_options": {"num_cpus": 1000}}, (400, 401, 403)),
        Hostile("admin load of 100 replicas", "POST", "/v1/admin/load-model",
                {"model_id": "many", "model_path": "default", "num_replicas": 100}, (400, 401, 403)),
        Hostile("prompt of 31M characters", "POST", "/v1/chat/completions",
                {"model": big, "messages": [{"role": "user", "content": huge}], "max_tokens": 2}, (400,)),
        Hostile("10,001 messages of 3 KB", "POST", "/v1/chat/completions",
                {"model": big, "messages": many, "max_tokens": 2}, (400,)),
        Hostile("count_tokens of 31M characters", "POST", "/v1/messages/count_tokens",
                {"model": big, "messages": [{"role": "user", "content": huge}]}, (400,)),
        Hostile("Responses with 7 MB ids", "POST", "/v1/responses",
                {"model": tiny, "input": "hi", "max_output_tokens": 4, "user": seven_mb, "prompt_cache_key": seven_mb,
                 "safety_identifier": seven_mb}, (400,)),
    ]


def with_hostile(shapes: list[Shape | Hostile], catalog: list[Hostile], count: int, seed: int) -> list[Shape | Hostile]:
    """The same normal shapes, with `count` hostile ones at seeded places (their own generator, so a run without
    them sends exactly the same normal requests)."""
    rng = np.random.default_rng(seed + 1)
    items = list(shapes)
    for _ in range(count):
        items.insert(int(rng.integers(0, len(items) + 1)), catalog[int(rng.integers(len(catalog)))])
    return items


async def send_hostile(session: aiohttp.ClientSession, url: str, item: Hostile, timeout_s: float) -> HostileAnswer:
    started = time.perf_counter()
    status = None
    try:
        async with session.request(item.method, url + item.path, json=item.body,
                                   timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            await resp.read()
            status = resp.status
    except (asyncio.TimeoutError, aiohttp.ClientError):
        pass
    return HostileAnswer(item.name, status, round(time.perf_counter() - started, 3), status in item.expect)


def hostile_report(answers: list[HostileAnswer]) -> dict[str, Any]:
    by_name: dict[str, dict[str, Any]] = {}
    for a in answers:
        row = by_name.setdefault(a.name, {"sent": 0, "statuses": Counter(), "max_s": 0.0})
        row["sent"] += 1
        row["statuses"][str(a.status)] += 1
        row["max_s"] = max(row["max_s"], a.seconds)
    return {"sent": len(answers), "refused_as_expected": sum(a.refused for a in answers),
            "over_bound": sum(a.seconds > HOSTILE_BOUND_S for a in answers), "bound_s": HOSTILE_BOUND_S,
            "max_s": max((a.seconds for a in answers), default=None),
            "by_name": {k: {**v, "statuses": dict(v["statuses"])} for k, v in by_name.items()}}


# ---- the requests
def plan(mix: Mix, tiny: str, smol: str | None) -> list[Shape]:
    rng = np.random.default_rng(mix.seed)
    prefixes = [random_words(rng, 48, TINY_VOCAB) for _ in range(4)]  # shared prefixes: the prefix cache works too
    shapes = []
    for index in range(mix.requests):
        is_smol = smol is not None and rng.random() < mix.smol_fraction
        api = str(rng.choice(["chat", "completions", "messages"], p=[0.4, 0.2, 0.4]))
        cut = _cut(rng) if rng.random() < mix.disconnect_fraction else None
        temperatures = [0.0, 0.7, 1.0] + ([1.5] if api != "messages" else [])  # Anthropic's range ends at 1
        shape = Shape(index, smol if is_smol else tiny, api, stream=cut is not None or rng.random() < mix.stream_fraction,
                      max_tokens=int(rng.integers(1, (mix.smol_max_tokens if is_smol else mix.max_tokens) + 1)),
                      temperature=float(rng.choice(temperatures)), prompt="", cut=cut)
        if is_smol:
            shape.prompt = str(rng.choice(SMOL_PROMPTS)).format(a=int(rng.integers(2, 50)), b=int(rng.integers(2, 50)),
                                                                name=str(rng.choice(NAMES)))
            shape.json_schema = api == "chat" and rng.random() < mix.json_fraction
            shape.max_tokens = 16 if shape.json_schema else shape.max_tokens  # {"answer": "yes"}: ~10 tokens
        else:
            words = int(np.exp(rng.uniform(np.log(4), np.log(mix.max_prompt_words))))
            shared = rng.random() < 0.5
            shape.prompt = (prefixes[int(rng.integers(4))] + " " if shared else "") + random_words(rng, words, TINY_VOCAB)
        if not shape.json_schema and rng.random() < mix.stop_fraction:
            pool = SMOL_STOPS if is_smol else [f"t{n}" for n in range(TINY_VOCAB - 16)]
            shape.stop = [str(s) for s in rng.choice(pool, size=int(rng.integers(1, 3)), replace=False)]
        shapes.append(shape)
    return shapes


def _cut(rng: np.random.Generator) -> Cut:
    if rng.random() < 1 / 3:  # by time: before the headers, during prefill, or mid-stream
        return Cut(0, at_s=float(rng.uniform(0.0, 0.3)))
    return Cut(int(rng.integers(0, 4)))  # 0: right after the headers, before the first event


@dataclass
class Lane:
    """Shapes sent by their own closed-loop workers."""

    shapes: list[Shape | Hostile]
    workers: int


def lanes(shapes: list[Shape], concurrency: int, smol: str | None, smol_concurrency: int) -> list[Lane]:
    """SmolLM2 gets at most `smol_concurrency` of the workers: in one closed loop its slow requests would hold
    most of them (a 5% share of the requests became ~80% of those in flight on a CPU)."""
    slow = [s for s in shapes if s.model == smol]
    fast = [s for s in shapes if s.model != smol]
    if not slow or not fast:
        return [Lane(shapes, concurrency)]
    smol_workers = max(1, min(smol_concurrency, concurrency - 1))
    return [Lane(fast, concurrency - smol_workers), Lane(slow, smol_workers)]


async def run_requests(url: str, plan_lanes: list[Lane], timeout_s: float, deadline: float,
                       headers: dict[str, str], hostile: list[HostileAnswer]) -> list[Answer]:
    """Each lane's workers send its shapes in order, each the next one when its last ended; none starts after
    `deadline`. Hostile ones' answers go to `hostile`."""
    answers: list[Answer] = []
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)  # send() bounds each request itself

    async def worker(pending: Iterator[Shape | Hostile]) -> None:
        for shape in pending:  # one iterator shared by a lane's workers (one event loop: no races)
            if time.perf_counter() > deadline:
                return
            if isinstance(shape, Hostile):
                hostile.append(await send_hostile(session, url, shape, timeout_s))
            else:
                answers.append(await send(session, url, shape, timeout_s))

    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers) as session:
        progress = asyncio.create_task(_progress(answers, sum(len(lane.shapes) for lane in plan_lanes)))
        iterators = [(iter(lane.shapes), lane.workers) for lane in plan_lanes]
        try:
            await asyncio.gather(*(worker(pending) for pending, workers in iterators for _ in range(workers)))
        finally:
            progress.cancel()
    return sorted(answers, key=lambda a: a.shape.index)


async def _progress(answers: list[Answer], total: int, every_s: float = 15.0) -> None:
    started = time.perf_counter()
    while True:
        await asyncio.sleep(every_s)
        counts = Counter(a.outcome for a in answers)
        print(f"[soak {time.perf_counter() - started:6.0f} s] {len(answers)}/{total} "
              + " ".join(f"{k} {v}" for k, v in sorted(counts.items())), flush=True)


# ---- one run
async def soak(args: argparse.Namespace, url: str, tiny: str, smol: str | None) -> dict[str, Any]:
    mix = Mix(args.requests, args.disconnect_fraction, args.smol_fraction if smol else 0.0, args.stream_fraction,
              args.stop_fraction, args.json_fraction, args.max_tokens, args.smol_max_tokens, args.max_prompt_words,
              args.seed)
    models = [tiny] + ([smol] if smol else [])
    headers = {"Authorization": f"Bearer {args.api_key}", "x-api-key": args.api_key} if args.api_key else {}
    shapes = plan(mix, tiny, smol)
    plan_lanes = lanes(shapes, args.concurrency, smol, args.smol_concurrency)
    plan_lanes[0].shapes = with_hostile(plan_lanes[0].shapes, hostile_catalog(tiny, smol),
                                        round(args.hostile_fraction * len(shapes)), args.seed)
    hostile: list[HostileAnswer] = []
    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=30)) as session:
        health_before, before = await read_health(session, url), await read_state(session, url, models)
        engines_before = await read_engines(session, url, models)
        started = time.perf_counter()
        answers = await run_requests(url, plan_lanes, args.request_timeout, started + args.max_seconds, headers,
                                     hostile)
        wall_s = time.perf_counter() - started
        settled = await settle(session, url, before, args.settle_seconds)
        health_after, engines_after = await read_health(session, url), await read_engines(session, url, models)
    report = summarize(answers, len(shapes), wall_s)
    report["hostile"] = hostile_report(hostile)
    report["engines_before"], report["engines_after"] = engines_before, engines_after
    report.update(health_before=health_before, health_after=health_after, state_before=asdict_map(before),
                  state_after=asdict_map(settled.models), idle_after=settled.idle, settle_s=settled.seconds)
    report["settings"] = {"url": url, "models": models, "concurrency": args.concurrency,
                          "lanes": [{"models": sorted({s.model for s in lane.shapes if isinstance(s, Shape)}), "requests": len(lane.shapes),
                                     "workers": lane.workers} for lane in plan_lanes], **asdict(mix),
                          "request_timeout_s": args.request_timeout, "max_seconds": args.max_seconds}
    report["verdict"] = verdict(report)
    return report


# ---- where the server is
def start_server(args: argparse.Namespace, folder: Path, log_path: Path, with_smol: bool) -> ServerProcess:
    """A tiny random model (serve_config.yaml's sizes unless --tiny-arg), plus serve_config.yaml's SmolLM2."""
    build_model(argparse.Namespace(random_shape="tiny", dtype="bfloat16", bits=None), folder, timeout_s=120)
    knobs = OrchardKnobs(decode_batch=32, model_args=["max_num_seqs=256", "queue_size=100", *args.tiny_arg])
    spec = orchard_spec(str(folder), TINY_ID, free_port(), knobs)
    if with_smol:
        spec.argv.append("--with-config-models")
    server = ServerProcess(spec, log_path, REPO)
    server.start()
    print(f"server ready in {server.wait_ready(args.startup_timeout):.1f} s (log {log_path})", flush=True)
    return server


async def wait_model(url: str, model: str, timeout_s: float) -> None:
    """Until `model` answers a one-token request (the server's ready probe asked only the first model)."""
    deadline = time.perf_counter() + timeout_s
    body = {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        while True:
            try:
                async with session.post(url + "/v1/chat/completions", json=body) as resp:
                    if resp.status == 200:
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            if time.perf_counter() > deadline:
                raise TimeoutError(f"{model} does not answer after {timeout_s:.0f} s")
            await asyncio.sleep(1.0)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000 (loopback unless --allow-remote)")
    where.add_argument("--start", action="store_true", help="start one: a tiny random model plus the default SmolLM2")
    p.add_argument("--allow-remote", action="store_true", help="let --url name a host beyond loopback")
    p.add_argument("--model", default=TINY_ID, help="with --url: the model most requests go to")
    p.add_argument("--smol-model", default=SMOL_ID, help="the model --smol-fraction goes to ('' for none)")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--disconnect-fraction", type=float, default=0.1)
    p.add_argument("--smol-fraction", type=float, default=0.05)
    p.add_argument("--smol-concurrency", type=int, default=4,
                   help="of the --concurrency workers, those that send the SmolLM2 requests (their own closed loop)")
    p.add_argument("--stream-fraction", type=float, default=0.6, help="of the requests not cut by the client")
    p.add_argument("--hostile-fraction", type=float, default=0.0,
                   help="hostile requests added among the normal ones, as a share of them (issue 48: 0.03)")
    p.add_argument("--stop-fraction", type=float, default=0.25, help="requests with stop strings")
    p.add_argument("--json-fraction", type=float, default=0.3, help="SmolLM2 chat requests with JSON-schema output")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens is drawn from 1..this")
    p.add_argument("--smol-max-tokens", type=int, default=8, help="the same for SmolLM2 (slow on a CPU)")
    p.add_argument("--max-prompt-words", type=int, default=512, help="tiny model prompts: 4..this words, log-uniform")
    p.add_argument("--request-timeout", type=float, default=120.0, help="a request still open after this is hung")
    p.add_argument("--max-seconds", type=float, default=1800.0, help="no request starts after this")
    p.add_argument("--settle-seconds", type=float, default=60.0, help="how long the server may take to become idle")
    p.add_argument("--api-key", default=os.environ.get("ORCHARD_API_KEYS", "").split(",")[0].strip() or None,
                   help="sent as Authorization: Bearer and x-api-key (default: the first of $ORCHARD_API_KEYS, the "
                        "server's own setting)")
    p.add_argument("--tiny-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="with --start: another field of the tiny model's entry, e.g. queue_size=8 (repeatable)")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="the JSON summary")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.start and sys.platform == "linux" and not in_loopback_namespace():
        print("--start: re-running inside scripts/loopback.sh (Ray needs a loopback-only namespace here)", flush=True)
        os.execv("/bin/sh", ["/bin/sh", str(REPO / "scripts" / "loopback.sh"), sys.executable, "-m", "bench.soak",
                             *(sys.argv[1:] if argv is None else argv)])
    smol = args.smol_model or None
    out = Path(args.out) if args.out else None
    log = out.with_name(out.stem + "_server.log") if out else Path(tempfile.gettempdir()) / f"soak_{os.getpid()}_server.log"
    server: ServerProcess | None = None
    with tempfile.TemporaryDirectory(prefix="orchard-soak-") as tmp:
        try:
            if args.start:
                server = start_server(args, Path(tmp) / TINY_ID, log, smol is not None)
                url, tiny = server.spec.target.base_url, TINY_ID
            else:
                url, tiny = check_loopback(args.url, args.allow_remote), args.model
            if smol:
                run_async(wait_model(url, smol, args.startup_timeout))
            report = run_async(soak(args, url, tiny, smol))
            if server is not None and server.proc is not None:
                report["serve_log_errors"] = serve_log_errors(server.proc.pid)
        except (RuntimeError, TimeoutError, OSError, aiohttp.ClientError) as exc:
            print(f"soak could not run: {type(exc).__name__}: {exc}", flush=True)
            return 2
        finally:
            if server is not None:
                server.stop()  # before the model folder goes
    report.update(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), git_commit=git_commit(),
                  argv=sys.argv[1:] if argv is None else argv, server_log=str(server.log_path) if server else None)
    show([table(report)])
    if out:
        write_json(out, report)
        print(f"wrote {out}")
    return 0 if report["verdict"]["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
