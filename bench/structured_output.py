"""Structured output at full speed? The in-process asyncio engine client, 32 slots, half constrained by a JSON schema.

1. mixed: `--concurrency` closed-loop slots; `--constrained` of them send JSON-schema requests back to
   back until each has `--gen-tokens` tokens, the others one free request of `--gen-tokens` tokens.
2. free: the same slots replay the same requests (same prompts, same token counts, ignore_eos)
   with no constraint. System tok/s of both and their ratio (the acceptance asks >= 0.85).
3. compile probe: with the free slots decoding, a request with a never-seen schema arrives: its
   TTFT, the same schema's TTFT once cached, a free request's TTFT, and the other streams'
   inter-token gaps while the schema compiled (against the gaps just before).

Random models need a tokenizer whose tokens spell real bytes: the WordLevel one of tests/support/random_model.py
is replaced by its synthetic byte-level BPE of the model's full vocabulary (write_byte_level_tokenizer).

    python -m bench.structured_output --random-shape qwen3-0.6b --json $OUT/structured.json
    python -m bench.structured_output --random-shape tiny --gen-tokens 48   # CPU smoke test
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from bench.engine_throughput import (
    close_engine_client,
    engine_core,
    greedy_request,
    is_finish,
    is_text_delta,
    json_schema_guide,
    load_orchard_model,
    model_info,
    report_header,
    start_engine_client,
)

BENCH_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "active": {"type": "boolean"},
        "score": {"type": "number", "minimum": 0, "maximum": 100},
    },
    "required": ["name", "age", "tags", "active", "score"],
    "additionalProperties": False,
}


# Free streams that keep decoding through the compile probe (cancelled once it is done).
PROBE_BACKGROUND_TOKENS = 2000


def probe_schema(tag: str) -> dict:
    """A typical never-seen schema (free strings, as users write them); only its first token is needed."""
    return {
        "type": "object",
        "properties": {f"name_{tag}": {"type": "string"}, "city": {"type": "string"}, "age": {"type": "integer"},
                       "tags": {"type": "array", "items": {"type": "string"}}},
        "required": [f"name_{tag}", "city", "age"],
    }


@dataclass
class StreamRecord:
    request_id: str
    submitted: float
    arrivals: list[float] = field(default_factory=list)  # when each delta reached the consumer
    tokens: int = 0
    text: str = ""
    finish_reason: str = ""


@dataclass
class PhaseResult:
    name: str
    wall_s: float
    generated_tokens: int
    tok_per_s: float
    requests: int
    constrained_requests: int = 0
    constrained_stopped: int = 0  # ended by their guide (complete JSON)
    constrained_valid: int = 0  # of those, parsed and validated


@dataclass
class ProbeResult:
    compile_ttft_s: float  # never-seen schema: compile + queue + prefill + first step
    cached_ttft_s: float
    free_ttft_s: float
    compile_window_s: float  # submit -> compiled (gaps "during" are measured in this window)
    gap_during_p50_ms: float
    gap_during_max_ms: float
    gap_before_p50_ms: float
    gap_before_max_ms: float


async def consume(engine, request, record: StreamRecord) -> StreamRecord:
    async for event in engine.submit(request):
        if is_text_delta(event):
            record.arrivals.append(time.perf_counter())
            record.tokens += len(event.token_ids)
            record.text += event.text
        elif is_finish(event):
            record.finish_reason = event.reason.value
    return record


class Bench:
    def __init__(self, engine, guides, vocab_size: int, args) -> None:
        self.engine = engine
        self.guides = guides  # the core's schema compiler and cache
        self.args = args
        self.vocab_size = vocab_size
        self._next = 0

    def prompt(self, rng: np.random.Generator) -> list[int]:
        return rng.integers(0, self.vocab_size - 16, size=self.args.prompt_tokens).tolist()

    def request(self, prompt: list[int], max_tokens: int, guided=None):
        self._next += 1
        return greedy_request(f"b{self._next}", prompt, max_tokens, ignore_eos=guided is None, guided=guided)

    async def constrained_slot(self, rng, plan: list[tuple[list[int], int]], records: list[StreamRecord]) -> None:
        """Schema requests back to back until the slot has gen_tokens; `plan` records (prompt, tokens)."""
        guided = json_schema_guide(BENCH_SCHEMA)
        produced = 0
        while produced < self.args.gen_tokens:
            prompt = self.prompt(rng)
            request = self.request(prompt, self.args.gen_tokens - produced, guided)
            record = await consume(self.engine, request, StreamRecord(request.request_id, time.perf_counter()))
            records.append(record)
            plan.append((prompt, record.tokens))
            produced += record.tokens

    async def replay_slot(self, plan: list[tuple[list[int], int]], records: list[StreamRecord]) -> None:
        for prompt, tokens in plan:
            request = self.request(prompt, tokens)
            records.append(await consume(self.engine, request, StreamRecord(request.request_id, time.perf_counter())))

    async def run_phase(self, name: str, plans: Optional[list[list]], seed: int) -> tuple[PhaseResult, list[list]]:
        """plans None: the mixed phase (records its constrained plans); else replay them unconstrained."""
        rng = np.random.default_rng(seed)
        free_plans = [[(self.prompt(rng), self.args.gen_tokens)] for _ in range(self.args.concurrency - self.args.constrained)]
        new_plans = [[] for _ in range(self.args.constrained)]
        constrained_records: list[StreamRecord] = []
        free_records: list[StreamRecord] = []
        start = time.perf_counter()
        tasks = [self.replay_slot(plan, free_records) for plan in free_plans]
        if plans is None:
            tasks += [self.constrained_slot(np.random.default_rng([seed, i]), new_plans[i], constrained_records)
                      for i in range(self.args.constrained)]
        else:
            tasks += [self.replay_slot(plan, free_records) for plan in plans]
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
        records = constrained_records + free_records
        total = sum(r.tokens for r in records)
        result = PhaseResult(name, wall, total, total / wall, len(records), len(constrained_records))
        stopped = [r for r in constrained_records if r.finish_reason == "stop"]
        result.constrained_stopped = len(stopped)
        result.constrained_valid = sum(_valid(r.text) for r in stopped)
        return result, new_plans

    async def probe(self, seed: int) -> ProbeResult:
        rng = np.random.default_rng(seed)
        background = [StreamRecord(f"bg{i}", time.perf_counter()) for i in range(self.args.concurrency - self.args.constrained)]
        tasks = [asyncio.ensure_future(consume(self.engine, self.request(self.prompt(rng), PROBE_BACKGROUND_TOKENS), r))
                 for r in background]
        while min(len(r.arrivals) for r in background) < 8:  # all streams decoding
            await asyncio.sleep(0.01)
        before_start = time.perf_counter()
        await asyncio.sleep(0.5)
        guided = json_schema_guide(probe_schema(str(time.time_ns())))
        compiled_at = asyncio.ensure_future(self._compiled_at(guided))
        first = await self._ttft(self.request(self.prompt(rng), 1, guided))
        compile_end = await compiled_at
        cached = await self._ttft(self.request(self.prompt(rng), 1, guided))
        free = await self._ttft(self.request(self.prompt(rng), 1))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        compile_start = first.submitted
        during = _gaps(background, compile_start, compile_end)
        before = _gaps(background, before_start, compile_start)
        return ProbeResult(
            compile_ttft_s=first.ttft, cached_ttft_s=cached.ttft, free_ttft_s=free.ttft,
            compile_window_s=compile_end - compile_start,
            gap_during_p50_ms=_ms(statistics.median(during)) if during else 0.0, gap_during_max_ms=_ms(max(during, default=0.0)),
            gap_before_p50_ms=_ms(statistics.median(before)) if before else 0.0, gap_before_max_ms=_ms(max(before, default=0.0)),
        )

    async def _compiled_at(self, guided) -> float:
        """When the compile worker finished (the window in which only compiling, not prefill, happens)."""
        while self.guides.cached(guided) is None:
            await asyncio.sleep(0.002)
        return time.perf_counter()

    async def _ttft(self, request) -> "_Timed":
        submitted = time.perf_counter()
        record = await consume(self.engine, request, StreamRecord(request.request_id, submitted))
        return _Timed(submitted, record.arrivals[0] - submitted if record.arrivals else float("nan"))


@dataclass
class _Timed:
    submitted: float
    ttft: float


def _gaps(records: list[StreamRecord], start: float, end: float) -> list[float]:
    """Inter-arrival gaps of each stream that overlap [start, end]."""
    gaps = []
    for record in records:
        times = record.arrivals
        gaps += [b - a for a, b in zip(times, times[1:]) if b > start and a < end]
    return gaps


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 2)


def _valid(text: str) -> bool:
    try:
        document = json.loads(text)
        import jsonschema

        jsonschema.validate(document, BENCH_SCHEMA)
    except ImportError:  # the lent GPU machine may lack jsonschema: parsing must do
        return True
    except Exception:
        return False
    return True


async def run_bench(model_path: str, args) -> dict:
    loaded = load_orchard_model(model_path)
    built = {}

    def build_core():  # on the engine's thread; we keep a hold of the core for its guide compiler
        built["core"] = engine_core(loaded, max_num_seqs=1024, max_decode_seqs=args.concurrency, enable_prefix_cache=False)
        return built["core"]

    engine = await start_engine_client(build_core)
    guides = built["core"].guides
    driver = Bench(engine, guides, loaded.vocab_size, args)
    try:
        started = time.perf_counter()
        guides.compile(json_schema_guide(BENCH_SCHEMA))  # the throughput phases measure masks, not compiles
        compile_s = time.perf_counter() - started
        warm, _ = await driver.run_phase("warm-up", None, seed=args.seed + 99)
        print(f"warm-up: {warm.generated_tokens} tokens in {warm.wall_s:.1f} s; bench schema compiled in {compile_s:.2f} s")
        phases = []
        for repetition in range(args.repeat):
            mixed, plans = await driver.run_phase("mixed", None, seed=args.seed + repetition)
            free, _ = await driver.run_phase("free", plans, seed=args.seed + repetition)
            phases += [mixed, free]
            print(f"  mixed {mixed.tok_per_s:8.1f} tok/s   free {free.tok_per_s:8.1f} tok/s   "
                  f"ratio {mixed.tok_per_s / free.tok_per_s:.3f}   constrained {mixed.constrained_requests} "
                  f"(stop {mixed.constrained_stopped}, valid {mixed.constrained_valid})", flush=True)
        probe = await driver.probe(args.seed)
        print(f"  TTFT new schema {probe.compile_ttft_s * 1e3:.0f} ms, cached {probe.cached_ttft_s * 1e3:.0f} ms, "
              f"free {probe.free_ttft_s * 1e3:.0f} ms; others' gaps during compile p50 {probe.gap_during_p50_ms} ms "
              f"max {probe.gap_during_max_ms} ms (before: p50 {probe.gap_before_p50_ms} max {probe.gap_before_max_ms})")
    finally:
        await close_engine_client(engine)
    ratios = [m.tok_per_s / f.tok_per_s for m, f in zip(phases[::2], phases[1::2])]
    return {"bench_schema_compile_s": compile_s, "phases": [asdict(p) for p in phases],
            "throughput_ratio_median": statistics.median(ratios), "probe": asdict(probe)}


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="mlx-lm model folder (its own tokenizer)")
    src.add_argument("--random-shape", help="random model: qwen3-0.6b, llama-3.1-8b, tiny")
    p.add_argument("--bits", type=int, default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--constrained", type=int, default=16)
    p.add_argument("--gen-tokens", type=int, default=256, help="tokens per slot")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--repeat", type=int, default=2, help="mixed/free pairs (median ratio reported)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write results here")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> dict:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="orchard-structured-") as tmp:
        model_path = args.model
        if args.random_shape:
            from tests.support.random_model import make_random_model, write_byte_level_tokenizer

            model_path = str(make_random_model(Path(tmp) / "model", args.random_shape, args.dtype, args.bits, args.seed))
            vocab_size = json.loads((Path(model_path) / "config.json").read_text())["vocab_size"]
            write_byte_level_tokenizer(Path(model_path), vocab_size)  # replaces the WordLevel one
        info = model_info(model_path, args.random_shape)
        results = asyncio.run(run_bench(model_path, args))
    report = {**report_header(args, info), "bench_schema": BENCH_SCHEMA, **results}
    print(f"\nthroughput mixed/free (median of {args.repeat}): {results['throughput_ratio_median']:.3f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    return report


if __name__ == "__main__":
    main()
