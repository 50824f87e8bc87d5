"""In-process decode throughput: mlx-lm ``generate_step`` / ``BatchGenerator`` vs our engine.

Same model, same seeded random prompts, one process. For each concurrency level every
engine is warmed up at that level (new kernel shapes compile on first use), then N
sequences are submitted at once and generated to completion with no stop tokens.

    python -m bench.engine_throughput --random-shape qwen3-0.6b --concurrency 1,8,32 --json out.json
    python -m bench.engine_throughput --model PATH --engines mlx_batch,orchard
    python -m bench.engine_throughput --random-shape qwen3-0.6b --engines mlx_batch,orchard --concurrency 128 \
        --join-every-steps 2 --mixed-lengths     # staggered arrivals of mixed lengths (issue 57)

Staggered arrivals: request i joins at the engine's step i * K (--join-every-steps K), so every engine sees the
same arrival pattern in its own steps; with --mixed-lengths the prompts are 1/4 to 7/4 of --prompt-tokens
(the same mean). mlx_forward (one length, all at once) does not run in that mode.

Also home of what the other benchmarks share: the engine API block (bench/'s only door to engine/ besides the
serving launcher), machine/commit/model facts for reports, seeded prompts.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import mlx.core as mx
import numpy as np

# mlx_forward: mlx-lm's model in a bare decode loop (argmax fed back, one step queued ahead): what running that
# forward once per token costs at best, with no sampling, scheduling or outputs.
ENGINES = ("mlx_step", "mlx_batch", "mlx_forward", "orchard")


@dataclass
class Emission:  # tokens that one request received at one moment
    at: float
    request_id: str
    num_tokens: int


@dataclass
class Trace:  # what one timed run observed; times are time.perf_counter() seconds
    start: float
    end: float = 0.0
    emissions: list[Emission] = field(default_factory=list)
    first_token_at: dict[str, float] = field(default_factory=dict)
    token_counts: dict[str, int] = field(default_factory=dict)

    def add(self, request_id: str, num_tokens: int, at: float) -> None:
        if num_tokens <= 0:
            return
        self.emissions.append(Emission(at, request_id, num_tokens))
        self.first_token_at.setdefault(request_id, at)
        self.token_counts[request_id] = self.token_counts.get(request_id, 0) + num_tokens


@dataclass
class RunResult:
    engine: str
    concurrency: int
    prompt_tokens: int
    gen_tokens_per_seq: int
    generated_tokens: int
    wall_s: float
    tok_per_s: float  # generated tokens / whole run, prefill included
    last_first_token_s: float  # start -> last request's first token (prompt processing)
    decode_tok_per_s: float  # tokens after the last first token / time after it
    ttft_mean_s: float
    ttft_max_s: float
    complete: bool  # every sequence produced exactly gen_tokens_per_seq tokens
    peak_memory_gb: float = 0.0  # MLX peak device memory during the timed run
    # Ours only: the engine thread's mean milliseconds per step in each phase (engine/core.py StepPhaseSeconds).
    step_phases_ms: Optional[dict] = None
    # With --step-trace: each step that returned tokens, as [ms since the step before (or the start), tokens].
    # Where steps that joined or dropped rows cost more than a full step (issue 57's leaving rows).
    step_trace: Optional[list] = None


def step_trace(trace: Trace) -> list[list]:
    """The run's steps from its emissions (one timestamp per step): [ms since the previous step, tokens]."""
    tokens_at: dict[float, int] = {}
    for emission in trace.emissions:
        tokens_at[emission.at] = tokens_at.get(emission.at, 0) + emission.num_tokens
    steps, previous = [], trace.start
    for at in sorted(tokens_at):
        steps.append([round(1e3 * (at - previous), 2), tokens_at[at]])
        previous = at
    return steps


def summarize(engine: str, num_seqs: int, prompt_tokens: int, gen_tokens: int, trace: Trace) -> RunResult:
    wall = trace.end - trace.start
    total = sum(trace.token_counts.values())
    ttfts = [t - trace.start for t in trace.first_token_at.values()] or [0.0]
    last_first = max(trace.first_token_at.values(), default=trace.end)
    decode_tokens = sum(e.num_tokens for e in trace.emissions if e.at > last_first)
    decode_s = trace.end - last_first
    counts = list(trace.token_counts.values())
    complete = len(counts) == num_seqs and all(n == gen_tokens for n in counts)
    return RunResult(
        engine=engine,
        concurrency=num_seqs,
        prompt_tokens=prompt_tokens,
        gen_tokens_per_seq=gen_tokens,
        generated_tokens=total,
        wall_s=wall,
        tok_per_s=total / wall if wall > 0 else 0.0,
        last_first_token_s=last_first - trace.start,
        decode_tok_per_s=decode_tokens / decode_s if decode_s > 0 else 0.0,
        ttft_mean_s=float(np.mean(ttfts)),
        ttft_max_s=float(np.max(ttfts)),
        complete=complete,
    )


def step_into(core, trace: Trace) -> None:
    """One engine step; its tokens are recorded at the moment they come back."""
    outputs = core.step()
    now = time.perf_counter()
    for out in outputs:
        trace.add(out.request_id, len(out.new_token_ids), now)


# ---- Orchard's engine API. Every import of engine/ in bench/ is in this block, except the serving launcher's
# (bench/serving/orchard_server.py) and random_model's byte table; the others call these. Imports are lazy:
# without a working engine the mlx-lm columns still run.
def check_engine_api() -> None:
    """Import what the orchard column needs (raises what a half-written engine raises), and apply the MLX
    settings the engine applies when it loads a model, before anything touches the device: mlx-lm's columns
    then run under the same settings as ours."""
    from engine import EngineConfig, EngineCore, Request, SamplingParams  # noqa: F401
    from engine.mlx_settings import apply_mlx_settings
    from engine.models.loader import load_model  # noqa: F401

    apply_mlx_settings()


def load_orchard_model(model_path: str):
    """The engine's loaded model (weights, tokenizer, vocab_size) from an mlx-lm model folder."""
    from engine.models.loader import load_model

    return load_model(model_path)


def engine_core(loaded, draft=None, **config):
    """An EngineCore with EngineConfig(**config); fields left out keep the engine's defaults. draft: the loaded
    draft model of a `speculative` config of method "draft"."""
    from engine import EngineConfig, EngineCore

    return EngineCore(loaded, EngineConfig(**config), draft=draft)


def warm_up(core) -> None:
    """What an engine client does before the first request: kernels built (prefill shapes, on a GPU the decode
    batch's), speculation's costs calibrated."""
    from engine.decode_warmup import warm_up_at_load

    warm_up_at_load(core)


def speculative_config(**fields):
    """The engine's SpeculativeConfig (method, num_draft_tokens, min_match, max_match, draft_model_path, ...)."""
    from engine.spec_decode.config import SpeculativeConfig

    return SpeculativeConfig(**fields)


def set_host_drafter(core, drafter) -> None:
    """Replace prompt lookup's drafts by drafter(request_id, known_tokens, length) -> tokens (a core of method
    "ngram"): a drafter of known agreement."""
    core.runner.speculation.speculator.host_drafter = drafter


def speculation_overhead(core):
    """The measured cost of a verifying step beyond a plain decode step, in plain steps (None: not measured)."""
    stats = core.stats().speculation
    return stats.verify_overhead if stats is not None else None


def speculation_counts(core) -> tuple[int, int]:
    """(drafted, accepted) tokens since the core started."""
    stats = core.stats().speculation
    return (stats.drafted_tokens, stats.accepted_tokens) if stats is not None else (0, 0)


def greedy_request(request_id: str, prompt: list[int], max_tokens: int, ignore_eos: bool = True, guided=None):
    """A temperature-0 request; max_tokens is always given (the core does not resolve a missing one)."""
    from engine import Request, SamplingParams

    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos, guided=guided)
    return Request(request_id=request_id, prompt_token_ids=prompt, sampling=sampling)


def json_schema_guide(schema: dict):
    """A guided-decoding constraint for `schema` (structured output)."""
    from engine.sampling.guided import GuidedDecoding

    return GuidedDecoding("json_schema", json.dumps(schema))


async def start_engine_client(build_core):
    """The asyncio client of a core that `build_core()` (no arguments) builds on the engine's own thread:
    `submit(request)` gives an async iterator of its admission, text deltas, then one finish event."""
    from engine.client.thread_client import ThreadEngineClient

    client = ThreadEngineClient(build_core)
    await client.start()
    return client


async def close_engine_client(client) -> None:
    await client.close()


def is_text_delta(event) -> bool:
    """A stream event that carries text (token_ids, text)."""
    from engine.output.request_output import TextDelta

    return isinstance(event, TextDelta)


def is_finish(event) -> bool:
    """The event that ends a stream (reason, usage)."""
    from engine.output.request_output import Finish

    return isinstance(event, Finish)


# ---- engines
class Runner:
    """One engine: ``run`` submits all prompts at once and generates them to completion."""

    name = ""

    def supports(self, concurrency: int) -> bool:
        return True

    def run(self, prompts: list[list[int]], gen_tokens: int, join_every: int = 0) -> Trace:
        """join_every > 0: prompt i joins at this engine's step i * join_every (0: all at once)."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class MlxStepRunner(Runner):
    """mlx-lm ``generate_step``: one sequence at a time, so only measured at concurrency 1."""

    name = "mlx_step"

    def __init__(self, model):
        self.model = model

    def supports(self, concurrency: int) -> bool:
        return concurrency == 1

    def run(self, prompts: list[list[int]], gen_tokens: int, join_every: int = 0) -> Trace:
        from mlx_lm.generate import generate_step

        trace = Trace(start=time.perf_counter())
        for i, prompt in enumerate(prompts):
            # generate_step yields Python ints (it calls .item()), so each token is real when seen.
            for _token, _ in generate_step(mx.array(prompt), self.model, max_tokens=gen_tokens):
                trace.add(str(i), 1, time.perf_counter())
        trace.end = time.perf_counter()
        return trace


class MlxForwardRunner(Runner):
    """mlx-lm's model alone: prefill all prompts in one forward, then a decode loop that feeds the argmax back
    with step N+1 queued before step N's tokens are read (as generate_step does); BatchKVCache for N > 1."""

    name = "mlx_forward"

    def __init__(self, model):
        self.model = model

    def run(self, prompts: list[list[int]], gen_tokens: int, join_every: int = 0) -> Trace:
        from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

        if len({len(p) for p in prompts}) != 1 or join_every:
            raise ValueError("mlx_forward takes prompts of one length, all at once (no padding, no joins)")
        trace = Trace(start=time.perf_counter())
        batched = len(prompts) > 1
        cache = [BatchKVCache([0] * len(prompts)) for _ in self.model.layers] if batched else make_prompt_cache(self.model)
        tokens = mx.argmax(self.model(mx.array(prompts), cache=cache)[:, -1], axis=-1)
        for produced in range(1, gen_tokens + 1):
            following = None
            if produced < gen_tokens:  # the last token is read with no step behind it
                following = mx.argmax(self.model(tokens[:, None], cache=cache)[:, -1], axis=-1)
                mx.async_eval(following)
            tokens.tolist()
            now = time.perf_counter()
            for i in range(len(prompts)):
                trace.add(str(i), 1, now)
            tokens = following
        trace.end = time.perf_counter()
        return trace


class MlxBatchRunner(Runner):
    """mlx-lm ``BatchGenerator`` with completion batch = concurrency and no stop tokens."""

    name = "mlx_batch"

    def __init__(self, model, prefill_batch_size: int):
        self.model = model
        self.prefill_batch_size = prefill_batch_size

    def run(self, prompts: list[list[int]], gen_tokens: int, join_every: int = 0) -> Trace:
        from mlx_lm.generate import BatchGenerator

        trace = Trace(start=time.perf_counter())
        gen = BatchGenerator(
            self.model,
            max_tokens=gen_tokens,
            stop_tokens=None,
            completion_batch_size=len(prompts),
            prefill_batch_size=self.prefill_batch_size,
        )
        step, joined, produced, wanted = 0, 0, 0, gen_tokens * len(prompts)
        while produced < wanted:
            due = len(prompts) if not join_every else min(len(prompts), step // join_every + 1)
            if due > joined:
                gen.insert(prompts[joined:due], [gen_tokens] * (due - joined))
                joined = due
            responses = gen.next_generated()
            step += 1
            now = time.perf_counter()
            for response in responses:
                trace.add(str(response.uid), 1, now)
            produced += len(responses)
            if not responses and joined == len(prompts):
                break  # nothing left to generate (a response short of gen_tokens shows as incomplete)
        trace.end = time.perf_counter()
        gen.close()
        return trace


class OrchardRunner(Runner):
    """Our EngineCore; one core per concurrency level (max_decode_seqs = N), kept for warm-up + run.

    With `stagger_s` > 0, request i is added i * stagger_s after the start, as HTTP clients arrive
    (bench.serving.engine_baseline); 0 adds them all at once, as the other engines get them.
    """

    name = "orchard"
    stagger_s = 0.0
    # The last run's mean wall and engine-thread CPU milliseconds per engine step, and per phase.
    step_ms_mean = 0.0
    step_cpu_ms_mean = 0.0
    step_phases_ms: Optional[dict] = None

    def __init__(self, model_path: str, prefill_batch_size: Optional[int], prefill_chunk_tokens: int, prefix_cache: bool):
        self.loaded = load_orchard_model(model_path)
        self.prefill_batch_size = prefill_batch_size  # None: the engine's default
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.prefix_cache = prefix_cache
        self._core = None
        self._core_concurrency = 0
        self._next_id = 0

    def _core_for(self, concurrency: int):
        if self._core is None or self._core_concurrency != concurrency:
            self.close()
            config = dict(max_num_seqs=1024, max_decode_seqs=concurrency, prefill_chunk_tokens=self.prefill_chunk_tokens,
                          enable_prefix_cache=self.prefix_cache)
            if self.prefill_batch_size is not None:
                config["max_prefill_seqs"] = self.prefill_batch_size
            self._core = engine_core(self.loaded, **config)
            self._core_concurrency = concurrency
        return self._core

    def run(self, prompts: list[list[int]], gen_tokens: int, join_every: int = 0) -> Trace:
        core = self._core_for(len(prompts))
        before = core.stats()  # outside the timed run
        trace = Trace(start=time.perf_counter())
        arrivals = [trace.start + i * self.stagger_s for i in range(len(prompts))]
        submitted = step = 0
        while submitted < len(prompts) or core.has_unfinished_requests():
            now = time.perf_counter()
            while submitted < len(prompts) and (
                    submitted * join_every <= step if join_every else arrivals[submitted] <= now):
                self._next_id += 1
                core.add_request(greedy_request(f"r{self._next_id}", prompts[submitted], gen_tokens))
                submitted += 1
            if not core.has_unfinished_requests() and not join_every:
                time.sleep(max(0.0, arrivals[submitted] - time.perf_counter()))
                continue
            step_into(core, trace)
            step += 1
        trace.end = time.perf_counter()
        after = core.stats()
        steps = max(1, after.num_steps - before.num_steps)
        self.step_ms_mean = 1e3 * (after.step_seconds_total - before.step_seconds_total) / steps
        self.step_cpu_ms_mean = 1e3 * (after.step_cpu_seconds_total - before.step_cpu_seconds_total) / steps
        self.step_phases_ms = {name: round(1e3 * (seconds - getattr(before.step_phases, name)) / steps, 3)
                               for name, seconds in asdict(after.step_phases).items()}
        self.step_phases_ms["steps"] = steps
        return trace

    def close(self) -> None:
        if self._core is not None:
            self._core.close()
            self._core = None


def orchard_importable() -> bool:
    try:
        check_engine_api()
    except Exception as exc:  # any failure of a half-written engine must not stop the mlx-lm columns
        print(f"[orchard] engine not importable, skipping its column: {type(exc).__name__}: {exc}")
        return False
    return True


def build_runners(names: list[str], model_path: str, args) -> list[Runner]:
    runners: list[Runner] = []
    if {"mlx_step", "mlx_batch", "mlx_forward"} & set(names):
        import mlx_lm

        model, _tokenizer = mlx_lm.load(model_path)
        if "mlx_step" in names:
            runners.append(MlxStepRunner(model))
        if "mlx_batch" in names:
            runners.append(MlxBatchRunner(model, args.prefill_batch_size))
        if "mlx_forward" in names:
            runners.append(MlxForwardRunner(model))
    if "orchard" in names and orchard_importable():
        try:
            rows = args.prefill_batch_size if args.orchard_prefill_batch_size is None else args.orchard_prefill_batch_size
            runners.append(OrchardRunner(model_path, rows or None, args.prefill_chunk_tokens, args.prefix_cache == "on"))
        except Exception:
            traceback.print_exc()
            print("[orchard] load_model failed, skipping its column")
    return runners


# ---- the benchmark
def make_prompts(num: int, length: int, vocab_size: int, seed: list[int], mixed: bool = False) -> list[list[int]]:
    """mixed: each prompt's length drawn from length/4 .. 7*length/4 (the same mean)."""
    # The top ids hold special tokens in our random models; keep prompts to plain words.
    rng = np.random.default_rng(seed)
    if not mixed:
        return rng.integers(0, max(vocab_size - 16, 2), size=(num, length)).tolist()
    lengths = rng.integers(max(1, length // 4), 7 * length // 4 + 1, size=num)
    return [rng.integers(0, max(vocab_size - 16, 2), size=int(n)).tolist() for n in lengths]


def free_memory() -> None:
    gc.collect()
    mx.clear_cache()


def bench_level(runner: Runner, concurrency: int, args, vocab_size: int) -> RunResult:
    # Prompts differ per level and from the warm-up's, so no prefix cache can help a timed run;
    # every engine gets the same prompts at the same level.
    warm = make_prompts(concurrency, args.prompt_tokens, vocab_size, [args.seed, concurrency, 1], args.mixed_lengths)
    runner.run(warm, min(args.warmup_tokens, args.gen_tokens), args.join_every_steps)
    free_memory()
    prompts = make_prompts(concurrency, args.prompt_tokens, vocab_size, [args.seed, concurrency, 0], args.mixed_lengths)
    mx.reset_peak_memory()
    trace = runner.run(prompts, args.gen_tokens, args.join_every_steps)
    result = summarize(runner.name, concurrency, args.prompt_tokens, args.gen_tokens, trace)
    result.peak_memory_gb = mx.get_peak_memory() / 1e9
    result.step_phases_ms = getattr(runner, "step_phases_ms", None)
    result.step_trace = step_trace(trace) if args.step_trace else None
    free_memory()
    return result


def run_all(runners: list[Runner], levels: list[int], args, vocab_size: int) -> list[RunResult]:
    # Engines alternate inside each level so slow drift of the machine hits all of them alike.
    results, failed = [], set()
    for concurrency, _repetition in ((c, r) for c in levels for r in range(args.repeat)):
        for runner in runners:
            if runner.name in failed or not runner.supports(concurrency):
                continue
            try:
                result = bench_level(runner, concurrency, args, vocab_size)
            except Exception:  # a failing engine drops its column, the others still run
                traceback.print_exc()
                print(
                    f"[{runner.name}] failed at concurrency {concurrency}; skipping it from here on "
                    f"(MLX memory GB: active {mx.get_active_memory() / 1e9:.2f}, "
                    f"cache {mx.get_cache_memory() / 1e9:.2f}, peak {mx.get_peak_memory() / 1e9:.2f})"
                )
                failed.add(runner.name)
                continue
            results.append(result)
            flag = "" if result.complete else "  INCOMPLETE"
            print(
                f"  {result.engine:<9} c={concurrency:<4} {result.tok_per_s:9.1f} tok/s  "
                f"wall {result.wall_s:7.2f} s  ttft {result.ttft_mean_s * 1e3:8.1f} ms  "
                f"peak {result.peak_memory_gb:6.2f} GB{flag}",
                flush=True,
            )
    return results


# ---- reporting
def _ratio(num: Optional[RunResult], den: Optional[RunResult]) -> str:
    if num is None or den is None or den.tok_per_s == 0:
        return "-"
    return f"{num.tok_per_s / den.tok_per_s:.2f}x"


def paired_ratio(results: list[RunResult], engine: str, other: str, concurrency: int, rate: str = "tok_per_s") -> str:
    """The median over repetitions of engine / other, each pair from the same repetition (engines alternate
    inside it): the lent machines drift by up to 30% within minutes, which a ratio of medians would keep."""
    ours = [getattr(r, rate) for r in results if r.engine == engine and r.concurrency == concurrency]
    theirs = [getattr(r, rate) for r in results if r.engine == other and r.concurrency == concurrency]
    ratios = [a / b for a, b in zip(ours, theirs) if b > 0]
    return f"{statistics.median(ratios):.2f}x" if ratios and len(ours) == len(theirs) else "-"


def median_results(results: list[RunResult]) -> dict[tuple[str, int], RunResult]:
    """With --repeat, the run of median throughput stands for each (engine, concurrency)."""
    groups: dict[tuple[str, int], list[RunResult]] = {}
    for result in results:
        groups.setdefault((result.engine, result.concurrency), []).append(result)
    return {key: sorted(runs, key=lambda r: r.tok_per_s)[len(runs) // 2] for key, runs in groups.items()}


def format_tables(results: list[RunResult], levels: list[int], engines: list[str]) -> str:
    by_key = median_results(results)
    step_at_1 = by_key.get(("mlx_step", 1))
    header = ["concurrency"] + [f"{e} tok/s" for e in engines]
    # Against BatchGenerator the system rate (prefill included); against the bare forward, which prefills every
    # prompt in one forward, the decode rate.
    paired = [(e, rate) for e, rate in (("mlx_batch", "tok_per_s"), ("mlx_forward", "decode_tok_per_s")) if e in engines]
    paired = paired if "orchard" in engines else []
    if "orchard" in engines:
        header += ["orchard/mlx_batch", "orchard/mlx_step"]
        header += [f"orchard/{e} paired" + (" decode" if rate != "tok_per_s" else "") for e, rate in paired]
    rows = [header]
    for c in levels:
        row = [str(c)]
        for e in engines:
            r = by_key.get((e, c))
            row.append(f"{r.tok_per_s:.1f}" if r else "-")
        if "orchard" in engines:
            ours = by_key.get(("orchard", c))
            row += [_ratio(ours, by_key.get(("mlx_batch", c))), _ratio(ours, step_at_1) if c == 1 else "-"]
            row += [paired_ratio(results, "orchard", e, c, rate) for e, rate in paired]
        rows.append(row)
    detail = [["engine", "conc", "wall s", "tok/s", "to last 1st tok s", "decode tok/s", "ttft mean ms", "ttft max ms", "complete"]]
    for r in results:
        detail.append([
            r.engine, str(r.concurrency), f"{r.wall_s:.2f}", f"{r.tok_per_s:.1f}", f"{r.last_first_token_s:.3f}",
            f"{r.decode_tok_per_s:.1f}", f"{r.ttft_mean_s * 1e3:.1f}", f"{r.ttft_max_s * 1e3:.1f}", str(r.complete),
        ])
    return _plain_table(rows) + "\n\n" + _plain_table(detail) + _phase_table(by_key, levels)


def _phase_table(by_key: dict[tuple[str, int], RunResult], levels: list[int]) -> str:
    """Our engine's mean step, split: scheduling, building the step on the host, waiting on the device, outputs."""
    rows = [["orchard conc", "steps", "schedule ms", "build ms", "wait ms", "output ms", "step ms"]]
    for c in levels:
        result = by_key.get(("orchard", c))
        phases = result.step_phases_ms if result is not None else None
        if phases:
            parts = [phases[name] for name in ("schedule", "build", "wait", "output")]
            rows.append([str(c), str(phases["steps"])] + [f"{ms:.2f}" for ms in parts] + [f"{sum(parts):.2f}"])
    return "\n\n" + _plain_table(rows) if len(rows) > 1 else ""


def _plain_table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _command_output(cmd: list[str]) -> Optional[str]:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=True)
        return done.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def machine_info() -> dict:
    import mlx_lm

    info = {
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "default_device": str(mx.default_device()),
        "metal_available": hasattr(mx, "metal") and mx.metal.is_available(),
        "cuda_available": hasattr(mx, "cuda") and mx.cuda.is_available(),
        "nvidia_smi": _command_output(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
        ),
        "cpu_count": os.cpu_count(),
    }
    try:
        info["device_info"] = {k: str(v) for k, v in mx.device_info().items()}
    except Exception:  # older MLX or no device query on this backend
        info["device_info"] = None
    return info


def git_commit() -> Optional[str]:
    repo = Path(__file__).resolve().parent.parent
    # The env var first: the device's copy of the tree may carry a stale .git.
    return os.environ.get("ORCHARD_COMMIT") or _command_output(["git", "-C", str(repo), "rev-parse", "HEAD"])


def model_info(model_path: str, shape: Optional[str]) -> dict:
    config = json.loads((Path(model_path) / "config.json").read_text())
    weights = sum(f.stat().st_size for f in Path(model_path).glob("*.safetensors"))
    return {
        "path": model_path,
        "random_shape": shape,
        "model_type": config.get("model_type"),
        "dtype": config.get("torch_dtype") or config.get("dtype"),
        "quantization": config.get("quantization"),
        "vocab_size": config.get("vocab_size"),
        "weights_gib": round(weights / 2**30, 3),
    }


# ---- CLI
def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="mlx-lm model folder")
    src.add_argument("--random-shape", help="build a random model: qwen3-0.6b, llama-3.1-8b, tiny")
    p.add_argument("--bits", type=int, default=None, help="quantize the random model (group 64)")
    p.add_argument("--dtype", default="bfloat16", help="dtype of the random model")
    p.add_argument("--concurrency", default="1,8,32,64,128", help="comma-separated levels")
    p.add_argument("--engines", default="mlx_step,mlx_batch,orchard", help=f"subset of {','.join(ENGINES)}")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--warmup-tokens", type=int, default=16, help="new tokens in each warm-up run")
    p.add_argument("--join-every-steps", type=int, default=0,
                   help="request i joins at the engine's step i*K (0: all at once); mlx_forward does not run")
    p.add_argument("--mixed-lengths", action="store_true", help="prompts of 1/4 to 7/4 of --prompt-tokens")
    p.add_argument("--prefill-batch-size", type=int, default=8, help="both batch engines (mlx-lm's default is 8)")
    p.add_argument("--orchard-prefill-batch-size", type=int, default=None,
                   help="ours alone, instead of --prefill-batch-size (0: the engine's own default, 32)")
    p.add_argument("--prefill-chunk-tokens", type=int, default=2048)
    # Off by default: mlx-lm's BatchGenerator has no prefix cache, and these prompts never share a prefix,
    # so "on" measures the cache's bookkeeping cost alone.
    p.add_argument("--prefix-cache", choices=["on", "off"], default="off")
    # Runs on the lent machines vary by up to 30%: repeat each level (engines alternating), report medians.
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-trace", action="store_true", help="keep each timed run's steps (ms, tokens) in the JSON")
    p.add_argument("--json", help="write results here")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> list[RunResult]:
    args = parse_args(argv)
    levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = set(engines) - set(ENGINES)
    if unknown:
        raise SystemExit(f"unknown engines {sorted(unknown)}; choose from {ENGINES}")
    if (args.join_every_steps or args.mixed_lengths) and "mlx_forward" in engines:
        print("mlx_forward takes one prompt length, all at once: left out of staggered / mixed-length runs")
        engines.remove("mlx_forward")
    with tempfile.TemporaryDirectory(prefix="orchard-bench-") as tmp:
        model_path = args.model
        if args.random_shape:
            from tests.support.random_model import make_random_model

            start = time.perf_counter()
            model_path = str(make_random_model(Path(tmp) / "model", args.random_shape, args.dtype, args.bits, args.seed))
            print(f"built random {args.random_shape} in {time.perf_counter() - start:.1f} s")
        info = model_info(model_path, args.random_shape)
        runners = build_runners(engines, model_path, args)
        print(f"engines {[r.name for r in runners]}, levels {levels}, device {mx.default_device()}")
        results = run_all(runners, levels, args, info["vocab_size"])
        for runner in runners:
            runner.close()
    print()
    print(format_tables(results, levels, [r.name for r in runners]))
    if args.json:
        write_report(Path(args.json), args, info, results)
    return results


def report_header(args: argparse.Namespace, info: dict) -> dict:
    """What every bench report starts with: when, which commit, machine, model and settings."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "machine": machine_info(),
        "model": info,
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
    }


def write_report(path: Path, args: argparse.Namespace, info: dict, results: list[RunResult]) -> None:
    report = {**report_header(args, info), "results": [asdict(r) for r in results]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
