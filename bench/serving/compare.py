"""Our server vs mlx_lm.server on one model, same workloads, one run; plus the in-process engine rate.

    python -m bench.serving.compare --random-shape qwen3-0.6b [--bits 4] --levels 1,4,8,16,32,64,128 \
        --servers orchard,mlx_lm --engine-baseline --efficiency-rounds 5 --json $OUT/serving_qwen3.json \
        --time-budget-s 480

Builds (or takes, --model) a model folder; for each server: start it as a child process (ours:
bench.serving.orchard_server), wait until it answers, run deployments.cli.loadgen.load's workloads, stop it;
then (--engine-baseline) measure bench.engine_throughput's orchard rate at the same levels and uniform
prompt/gen sizes in a child process (bench.serving.engine_baseline). --efficiency-rounds K also
alternates, right after our server's sweep, K rounds of the uniform 64-stream level over HTTP and in a
loaded engine child: a ratio from the same minutes of a drifting machine. Everything lands in one JSON,
rewritten after each step, so a run cut short leaves its partial results. On Linux dev machines run it
whole under scripts/loopback.sh (Ray inside). MLX and Ray stay out of this process: children do that work.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import httpx

from bench.serving.engine_baseline import EngineChild, alternate
from bench.serving.orchard_server import config_applications, mlx_backend_env
from bench.serving.reports import acceptance_checks, comparison_tables
from deployments.cli.loadgen.client import Target
from deployments.cli.loadgen.load import add_load_arguments, run_async, run_suite, settings_from_args, suite_tables, to_jsonable, write_json
from deployments.cli.loadgen.tables import show
from deployments.cli.loadgen.workloads import LoadSettings

REPO = Path(__file__).resolve().parents[2]
# and orchard_rN: ours with N replicas (issue 56's pairing: orchard_r2,orchard_r1). rapid_mlx: Rapid-MLX (issue 57's
# report), from the site folder RAPID_MLX_SITE names (its own mlx-lm, older than ours: bench/README.md builds it).
SERVERS = ("orchard", "mlx_lm", "rapid_mlx")
REPLICA_PHASE = re.compile(r"orchard_r([1-9][0-9]*)(?:#[0-9]+)?$")
# Time-budget shares. Our server's phase holds its start: 95-115 s of prefill-shape warm-up on the H100 against
# mlx_lm.server's ~22 s (at 1.0 / 1.3 the 2026-11-25 sweeps lost our burst and long phases while mlx_lm.server
# and the engine used a third of theirs: commit 4ccf0ac). The engine run is short.
PHASE_WEIGHTS = {"orchard": 1.8, "mlx_lm": 1.0, "rapid_mlx": 1.2, "engine": 0.4}
STOP_RESERVE_S = 20.0  # stopping a server (Ray shutdown) within its phase
EFFICIENCY_LEVEL = 64  # the acceptance point's concurrency
END_RESERVE_S = 10.0  # tables and the final JSON


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="mlx-lm model folder (random-weight WordLevel models give exact token counts)")
    src.add_argument("--random-shape", help="build a random model: qwen3-0.6b, llama-3.1-8b, tiny")
    p.add_argument("--bits", type=int, default=None, help="quantize the random model (group 64)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--servers", default="orchard,mlx_lm", help=f"subset of {','.join(SERVERS)}, in run order")
    p.add_argument("--engine-baseline", action="store_true", help="also the in-process engine rate (uniform sizes)")
    p.add_argument("--json", required=True, help="the report (rewritten after every step)")
    p.add_argument("--log-dir", help="server logs (default: next to --json)")
    p.add_argument("--time-budget-s", type=float, default=480.0, help="the whole run, model build included")
    p.add_argument("--startup-timeout-s", type=float, default=240.0)
    p.add_argument("--prefill-batch", type=int, default=None,
                   help="ours and the engine baseline: max_prefill_seqs (default: serve_config.yaml's model entry)")
    p.add_argument("--chunked-prefill-tokens", type=int, default=2048, help="ours: prefill_chunk_tokens")
    p.add_argument("--context-length", type=int, default=None, help="ours: context_length (default: the model's)")
    p.add_argument("--throughput-optimized", action="store_true", help="ours: RAY_SERVE_THROUGHPUT_OPTIMIZED=1")
    p.add_argument("--prefix-cache", choices=["on", "off"], default="on", help="ours and the engine baseline")
    p.add_argument("--orchard-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="ours: another model entry field, e.g. queue_size=1024; a dotted KEY sets a nested field, "
                        "e.g. advanced.prefill_warmup_seconds=15 (repeatable)")
    p.add_argument("--gpus-per-replica", type=float, default=0.0,
                   help="orchard_rN phases: ray_actor_options.num_gpus of each replica (1: one GPU each)")
    p.add_argument("--mlx-prompt-concurrency", type=int, default=16, help="mlx_lm.server --prompt-concurrency")
    p.add_argument("--efficiency-rounds", type=int, default=0,
                   help="ours: after the sweep, K alternating rounds of uniform load over HTTP and in process")
    p.add_argument("--efficiency-level", type=int, default=EFFICIENCY_LEVEL,
                   help=f"the alternating rounds' concurrency (default {EFFICIENCY_LEVEL}; 1: the lone stream of issue 32)")
    add_load_arguments(p)
    return p.parse_args(argv)


# ---- servers under test: child processes, started, polled until they answer, stopped (bounded at every step).
# Each runs in its own session (process group), so stopping it also ends the processes it started
# (Ray's raylet and workers; mlx_lm.server's threads live in one process).
@dataclass
class ServerSpec:
    name: str
    argv: list[str]
    target: Target
    env: dict[str, str] = field(default_factory=dict)
    health_path: Optional[str] = None  # GET must answer 200 before the first probe request
    # An orchard_rN phase: ready once /v1/queue/stats lists N replicas of the model (the first one answers while
    # the others still load: the second pair of 2026-11-30 measured its first level on one replica).
    replicas: int = 1


@dataclass
class OrchardKnobs:
    decode_batch: int = 128
    prefill_batch: Optional[int] = None  # None: the model entry's
    chunked_prefill_tokens: int = 2048
    context_length: Optional[int] = None
    throughput_optimized: bool = False
    prefix_cache: bool = True
    model_args: list[str] = field(default_factory=list)  # KEY=VALUE, more model entry fields


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def orchard_spec(model_path: str, model_id: str, port: int, knobs: OrchardKnobs) -> ServerSpec:
    argv = [sys.executable, "-m", "bench.serving.orchard_server", "--model", model_path, "--model-id", model_id,
            "--port", str(port), "--decode-batch", str(knobs.decode_batch),
            "--chunked-prefill-tokens", str(knobs.chunked_prefill_tokens),
            "--max-num-seqs", str(max(512, 2 * knobs.decode_batch))]
    if knobs.prefill_batch:
        argv += ["--prefill-batch", str(knobs.prefill_batch)]
    if knobs.context_length:
        argv += ["--context-length", str(knobs.context_length)]
    if knobs.throughput_optimized:
        argv.append("--throughput-optimized")
    if not knobs.prefix_cache:
        argv.append("--no-prefix-cache")
    for item in knobs.model_args:
        argv += ["--model-arg", item]
    target = Target(f"http://127.0.0.1:{port}", model_id, "orchard", extra_body={"ignore_eos": True})
    return ServerSpec("orchard", argv, target, health_path="/health")


def mlx_lm_spec(model_path: str, port: int, decode_concurrency: int, prompt_concurrency: int) -> ServerSpec:
    argv = [sys.executable, "-m", "mlx_lm", "server", "--model", model_path, "--host", "127.0.0.1", "--port", str(port),
            "--decode-concurrency", str(decode_concurrency), "--prompt-concurrency", str(prompt_concurrency)]
    # "default_model" is the --model folder; any other name would be loaded as a path or Hub repo.
    # mlx_lm.server has no ignore_eos (it ignores unknown fields); random models rarely emit EOS.
    # The same MLX backend settings as our engine applies to itself, so the servers differ only in themselves.
    return ServerSpec("mlx_lm", argv, Target(f"http://127.0.0.1:{port}", "default_model", "mlx_lm"), env=mlx_backend_env())


def rapid_mlx_spec(model_path: str, port: int, decode_concurrency: int) -> ServerSpec:
    """Rapid-MLX 0.16 serving the folder as bench-model: its decode batch (--completion-batch-size, default 32) as
    wide as mlx_lm.server's, its prefix cache on (its default, as ours), nothing written to disk or downloaded."""
    argv = [sys.executable, "-c", "from rapid_mlx.cli import cli_entrypoint; cli_entrypoint()", "serve", model_path,
            "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "bench-model", "--yes", "--no-preflight",
            "--disable-disk-caches", "--disable-model-downloads", "--completion-batch-size", str(decode_concurrency),
            "--max-num-seqs", str(max(256, 2 * decode_concurrency)),
            "--max-concurrent-requests", str(max(256, 4 * decode_concurrency))]
    site = os.environ.get("RAPID_MLX_SITE", "")
    path = os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH", "")) if p)
    target = Target(f"http://127.0.0.1:{port}", "bench-model", "rapid_mlx", extra_body={"ignore_eos": True})
    return ServerSpec("rapid_mlx", argv, target, env={**mlx_backend_env(), **({"PYTHONPATH": path} if path else {})})


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
            if http.post(target.base_url + "/v1/chat/completions", json=body).status_code != 200:
                return False
            if self.spec.replicas <= 1:
                return True
            rows = http.get(target.base_url + "/v1/queue/stats").json().get("models") or []
            row = next((r for r in rows if r.get("id") == target.model), None) or {}
            return len(row.get("replicas") or []) >= self.spec.replicas
        except (httpx.HTTPError, ValueError):
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


# ---- facts about the run
def _python_json(code: str, timeout_s: float = 60.0) -> Optional[dict]:
    """Run a snippet in a child Python (keeps MLX and Ray out of this process); its last stdout line is JSON."""
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s,
                              cwd=REPO, check=True)
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def machine_facts() -> Optional[dict]:
    return _python_json(
        "import json\nfrom bench.engine_throughput import machine_info\ninfo = machine_info()\n"
        "try:\n import ray; info['ray'] = ray.__version__\nexcept Exception: info['ray'] = None\n"
        "import aiohttp; info['aiohttp'] = aiohttp.__version__\nprint(json.dumps(info))"
    )


def git_commit() -> Optional[str]:
    if os.environ.get("ORCHARD_COMMIT"):
        return os.environ["ORCHARD_COMMIT"]
    try:
        done = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        return done.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def model_facts(model_path: str, args: argparse.Namespace) -> dict[str, Any]:
    config = json.loads((Path(model_path) / "config.json").read_text())
    weights = sum(f.stat().st_size for f in Path(model_path).glob("*.safetensors"))
    return {
        "path": model_path, "random_shape": args.random_shape, "model_type": config.get("model_type"),
        "dtype": config.get("torch_dtype") or config.get("dtype"), "quantization": config.get("quantization"),
        "vocab_size": config.get("vocab_size"), "max_position_embeddings": config.get("max_position_embeddings"),
        "weights_gib": round(weights / 2**30, 3),
    }


def build_model(args: argparse.Namespace, folder: Path, timeout_s: float) -> str:
    argv = [sys.executable, "-m", "tests.support.random_model", str(folder), "--shape", args.random_shape, "--dtype", args.dtype]
    if args.bits:
        argv += ["--bits", str(args.bits)]
    started = time.perf_counter()
    subprocess.run(argv, cwd=REPO, check=True, timeout=timeout_s)  # its own process: MLX memory is returned at exit
    print(f"built random {args.random_shape} model in {time.perf_counter() - started:.1f} s", flush=True)
    return str(folder)


# ---- phases
class Run:
    """The report and the clock of one comparison."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.started = time.perf_counter()
        self.deadline = self.started + args.time_budget_s - END_RESERVE_S
        self.json_path = Path(args.json)
        self.log_dir = Path(args.log_dir) if args.log_dir else self.json_path.parent / f"logs_{self.json_path.stem}"
        self.report: dict[str, Any] = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git_commit": git_commit(), "machine": None, "model": None, "settings": None,
            "servers": {}, "server_info": {}, "engine": None, "checks": [], "events": [],
        }

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def phase_budget(self, phase: str, phases_left: list[str]) -> float:
        """A weighted share of what is left; our server's phase also gets the efficiency rounds' reserve on top."""
        reserve = efficiency_reserve_s(self.args.efficiency_rounds) if "orchard" in phases_left else 0.0
        total = sum(phase_weight(p) for p in phases_left)
        share = (self.left() - reserve) * phase_weight(phase) / total
        return share + (reserve if phase == "orchard" else 0.0)

    def event(self, text: str) -> None:
        stamp = round(time.perf_counter() - self.started, 1)
        self.report["events"].append(f"{stamp:7.1f} s  {text}")
        print(f"[compare {stamp:6.1f} s] {text}", flush=True)

    def save(self) -> None:
        self.report["checks"] = acceptance_checks(self.report)
        write_json(self.json_path, self.report)


def phase_weight(phase: str) -> float:
    return PHASE_WEIGHTS["orchard"] if REPLICA_PHASE.match(phase) else PHASE_WEIGHTS[phase]


def replica_args(name: str, gpus_per_replica: float) -> list[str]:
    """The model entry fields of an orchard_rN phase: N replicas (each with its GPUs); none for other phases."""
    match = REPLICA_PHASE.match(name)
    if not match:
        return []
    fields = [f"num_replicas={match.group(1)}"]
    return fields + ([f"ray_actor_options.num_gpus={gpus_per_replica:g}"] if gpus_per_replica else [])


def run_server_phase(run: Run, name: str, model_path: str, settings: LoadSettings, budget_s: float) -> None:
    args = run.args
    port = free_port()
    if name == "orchard" or REPLICA_PHASE.match(name):
        knobs = OrchardKnobs(max(settings.levels + [settings.burst_size, settings.long_background + 1]),
                             args.prefill_batch, args.chunked_prefill_tokens, args.context_length, args.throughput_optimized,
                             args.prefix_cache == "on", list(args.orchard_arg) + replica_args(name, args.gpus_per_replica))
        spec = orchard_spec(model_path, "bench-model", port, knobs)
        spec.name = spec.target.name = name
        match = REPLICA_PHASE.match(name)
        spec.replicas = int(match.group(1)) if match else 1
    else:
        decode = max(settings.levels + [settings.burst_size, settings.long_background + 1])
        spec = (rapid_mlx_spec(model_path, port, decode) if name == "rapid_mlx"
                else mlx_lm_spec(model_path, port, decode, args.mlx_prompt_concurrency))
    phase_end = time.perf_counter() + budget_s
    server = ServerProcess(spec, run.log_dir / f"{name}.log", REPO)
    info: dict[str, Any] = {"argv": spec.argv[1:], "log": str(server.log_path), "target": to_jsonable(spec.target)}
    run.report["server_info"][name] = info
    run.event(f"starting {name} on port {port} (phase budget {budget_s:.0f} s)")
    try:
        server.start()
        info["ready_s"] = round(server.wait_ready(min(args.startup_timeout_s, 0.6 * budget_s)), 1)
        run.event(f"{name} ready after {info['ready_s']} s")
        rounds = args.efficiency_rounds if name == "orchard" else 0
        suite_deadline = phase_end - STOP_RESERVE_S - efficiency_reserve_s(rounds)

        def on_result(suite: Any) -> None:  # after every level: a run cut short keeps what it measured
            run.report["servers"][name] = to_jsonable(suite)
            run.save()

        suite = run_async(run_suite(spec.target, settings, suite_deadline, on_result=on_result))
        run.report["servers"][name] = to_jsonable(suite)
        show(suite_tables(suite))
        if rounds:
            run_efficiency_rounds(run, spec.target, model_path, settings, phase_end - STOP_RESERVE_S)
    except Exception as exc:  # a server that fails to start or dies: recorded, and the next one still runs
        info["error"] = f"{type(exc).__name__}: {exc}"[:4000]
        run.event(f"{name} failed: {type(exc).__name__}: {str(exc)[:2000]}")
    finally:
        if name.startswith("orchard"):  # tracebacks, and the engines' load, warm-up and slow-step lines
            save_ray_log_tails(run.log_dir / "ray_serve_tails.log", heading=name)
        stop_started = time.perf_counter()
        server.stop()
        info["stop_s"] = round(time.perf_counter() - stop_started, 1)
        run.event(f"{name} stopped in {info['stop_s']} s")
        run.save()


def save_ray_log_tails(dest: Path, lines: int = 200, heading: str = "") -> None:
    """Append the ends of Ray Serve's own logs (replica tracebacks live there, not in the launcher's output) and the
    engine processes' log lines (their load, warm-up and step-budget timings) from the workers' logs."""
    logs = Path(tempfile.gettempdir()) / "ray" / "session_latest" / "logs"
    parts = [f"######## {heading}"] if heading else []
    for path in sorted((logs / "serve").glob("*.log")):
        tail = path.read_text(errors="replace").splitlines()[-lines:]
        parts.append(f"==== {path.name}\n" + "\n".join(tail))
    engine = [line for path in sorted(logs.glob("worker-*"))
              for line in path.read_text(errors="replace").splitlines() if "engine-process" in line]
    if engine:
        parts.append("==== engine processes\n" + "\n".join(engine[-lines:]))
    if parts:
        dest.parent.mkdir(parents=True, exist_ok=True)
        with dest.open("a") as out:
            out.write("\n".join(parts) + "\n")


def engine_baseline_argv(args: argparse.Namespace, model_path: str, settings: LoadSettings) -> list[str]:
    """bench.serving.engine_baseline with the sweep's request shapes and our engine settings (levels and JSON left out)."""
    argv = [sys.executable, "-m", "bench.serving.engine_baseline", "--model", model_path, "--prompt-tokens",
            str(settings.prompt_tokens), "--gen-tokens", str(settings.gen_tokens), "--prefill-chunk-tokens",
            str(args.chunked_prefill_tokens), "--prefix-cache", args.prefix_cache, "--stagger-ms", str(settings.stagger_ms),
            "--seed", str(settings.seed)]
    return argv + (["--prefill-batch-size", str(args.prefill_batch)] if args.prefill_batch else [])


def efficiency_reserve_s(rounds: int) -> float:
    """Seconds kept from our server's sweep for the alternating rounds (the engine child loads in the first)."""
    return 20.0 + 12.0 * rounds if rounds > 0 else 0.0


def run_efficiency_rounds(run: Run, target: Any, model_path: str, settings: LoadSettings, deadline: float) -> None:
    json_path = run.json_path.parent / f".{run.json_path.stem}_efficiency_engine.json"
    argv = engine_baseline_argv(run.args, model_path, settings) + ["--json", str(json_path)]
    level = run.args.efficiency_level
    run.event(f"efficiency: {run.args.efficiency_rounds} alternating rounds at c={level}")
    engine = EngineChild(argv, REPO, run.log_dir / "efficiency_engine.log")
    try:
        result = run_async(alternate(target, engine, settings, level, run.args.efficiency_rounds, deadline))
        run.report["efficiency"] = result.to_json()
    except Exception as exc:  # the sweep's figures stand without it
        run.report["efficiency"] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        run.event(f"efficiency rounds failed: {type(exc).__name__}: {exc}")
    finally:
        engine.close()
        json_path.unlink(missing_ok=True)
        run.save()


def run_engine_phase(run: Run, model_path: str, settings: LoadSettings, budget_s: float) -> None:
    """bench.serving.engine_baseline in a child process; the levels it finished count even if the budget stops it."""
    path = run.json_path.parent / f".{run.json_path.stem}_engine.json"
    argv = engine_baseline_argv(run.args, model_path, settings) + [
        "--levels", ",".join(map(str, settings.levels)), "--json", str(path)]
    run.event(f"engine baseline (budget {budget_s:.0f} s)")
    try:
        subprocess.run(argv, cwd=REPO, timeout=max(5.0, budget_s), check=False)
    except subprocess.TimeoutExpired:
        run.event("engine baseline stopped by the time budget; keeping the levels it finished")
    try:
        run.report["engine"] = json.loads(path.read_text())
        path.unlink()
    except (OSError, ValueError) as exc:
        run.report["engine"] = {"error": f"no engine results: {exc}"}
    run.save()


def main(argv: Optional[list[str]] = None) -> dict:
    args = parse_args(argv)
    if args.prefill_batch is None:  # the server's and the engine baseline's: the same, as the server is configured
        args.prefill_batch = config_applications()[1]["args"].get("max_prefill_seqs")
    run = Run(args)
    servers = phase_names(args.servers)
    with tempfile.TemporaryDirectory(prefix="orchard-compare-") as tmp:
        model_path = args.model or build_model(args, Path(tmp) / "model", timeout_s=max(30.0, 0.4 * run.left()))
        run.report["model"] = model_facts(model_path, args)
        run.report["machine"] = machine_facts()
        settings = settings_from_args(args, run.report["model"]["vocab_size"])
        run.report["settings"] = {"load": to_jsonable(settings), "compare": {k: v for k, v in vars(args).items() if k != "json"}}
        _warn_context(run, settings)
        run.save()
        phases = servers + (["engine"] if args.engine_baseline else [])
        for i, phase in enumerate(phases):
            budget = run.phase_budget(phase, phases[i:])
            if budget < 15.0:
                run.event(f"skipping {phase}: {budget:.0f} s left")
                continue
            if phase == "engine":
                run_engine_phase(run, model_path, settings, budget)
            else:
                run_server_phase(run, phase, model_path, settings, budget)
    run.report["wall_s"] = round(time.perf_counter() - run.started, 1)
    run.save()
    print()
    show(comparison_tables(run.report))
    print(f"\nwrote {run.json_path} in {run.report['wall_s']} s")
    return run.report


def phase_names(servers: str) -> list[str]:
    """--servers as phase names; a repeated orchard_rN (alternating rounds) is named orchard_rN#2, #3, ..."""
    names: list[str] = []
    for server in (s.strip() for s in servers.split(",") if s.strip()):
        if server not in SERVERS and not REPLICA_PHASE.match(server):
            raise SystemExit(f"unknown server {server!r}; choose from {SERVERS} or orchard_rN (N replicas)")
        if server in names and not REPLICA_PHASE.match(server):
            raise SystemExit(f"{server!r} twice: only orchard_rN phases repeat")
        names.append(server if server not in names else f"{server}#{sum(n.split('#')[0] == server for n in names) + 1}")
    return names


def _warn_context(run: Run, settings: LoadSettings) -> None:
    limit = run.args.context_length or run.report["model"].get("max_position_embeddings") or 0
    need = settings.long_prompt_tokens + settings.long_gen_tokens + 32
    if "long" in settings.workloads and limit and need > limit:
        run.event(f"warning: long prompt ({need} tokens with template) exceeds the context ({limit}); "
                  "use --long-prompt-tokens or --context-length")


if __name__ == "__main__":
    main()
