"""A burst through ModelService in one process (no HTTP, no Ray), with the event loop's and the GIL's stalls.

    python -m bench.service_burst --random-shape qwen3-0.6b --burst 32 --prompt-words 512 --bursts 3

Between bench.engine_burst (EngineCore alone, prompts already tokenized) and the server: the requests go
through ModelService.generate as the ingress hands them over (chat template and tokenization on the event
loop, the engine thread, coalesced chunks). Per burst: lone and burst TTFT, when each request was submitted to
the engine (its `started` log line), two stall meters running meanwhile (a thread that asks for the GIL every
millisecond, an asyncio task that asks for the event loop every millisecond: the longest waits say whether
something kept the other side out) and the garbage collector's passes (`--gc-freeze` tries gc.freeze()).
With --engine-thread the engine runs on a thread of this process (not its own process) through
bench.timed_core, and each burst also reports the P95 request's timeline: submitted, taken in by the engine
thread, its first token's step ended, its first chunk here; and the burst's steps.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import random
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field

from bench.engine_burst import p95_nearest_rank
from bench.random_model import make_random_model
from bench.timed_core import CoreTimeline, build_timed_core
from deployments.config import ModelConfig
from deployments.model_service import ModelService, core_spec
from engine import AsyncEngine
from deployments.protocol import ChatPrompt, GenerateJob
from engine.sampling.params import SamplingParams

TICK_S = 0.001


@dataclass
class StallMeter:
    """Lateness of 1 ms sleeps, as (start offset, ms late) for those later than `report_ms`."""

    report_ms: float = 3.0
    stalls: list[tuple[float, float]] = field(default_factory=list)
    origin: float = 0.0

    def note(self, asked: float, late_s: float) -> None:
        if late_s * 1e3 >= self.report_ms:
            self.stalls.append((round(1e3 * (asked - self.origin), 1), round(1e3 * late_s, 1)))

    def summary(self) -> dict:
        worst = sorted(self.stalls, key=lambda s: -s[1])[:8]
        return {"stalls_over_ms": self.report_ms, "count": len(self.stalls),
                "total_ms": round(sum(s[1] for s in self.stalls), 1), "worst_at_ms_late_ms": worst}


def gil_meter(meter: StallMeter, stop: threading.Event) -> None:
    while not stop.is_set():
        asked = time.perf_counter()
        time.sleep(TICK_S)
        meter.note(asked, time.perf_counter() - asked - TICK_S)


async def loop_meter(meter: StallMeter, stop: asyncio.Event) -> None:
    while not stop.is_set():
        asked = time.perf_counter()
        await asyncio.sleep(TICK_S)
        meter.note(asked, time.perf_counter() - asked - TICK_S)


class GcTimer:
    """Durations of the garbage collector's passes (generation 2: the whole heap), through gc.callbacks."""

    def __init__(self) -> None:
        self.passes: list[tuple[int, float]] = []
        self._started = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.passes.append((info["generation"], time.perf_counter() - self._started))

    def summary(self) -> dict:
        by_generation = {}
        for generation in (0, 1, 2):
            times = [t for g, t in self.passes if g == generation]
            by_generation[f"gen{generation}"] = {"count": len(times), "max_ms": round(1e3 * max(times, default=0), 1),
                                                 "total_ms": round(1e3 * sum(times), 1)}
        return by_generation


class StartedLog(logging.Handler):
    """perf_counter time of each `request ... started` line (ModelService logs it once the engine has it)."""

    def __init__(self) -> None:
        super().__init__()
        self.started: dict[str, float] = {}

    def emit(self, record: logging.LogRecord) -> None:
        if "started" in record.msg and record.args:
            self.started[str(record.args[0])] = time.perf_counter()


def make_job(rng: random.Random, words: int, gen: int, vocab: int) -> GenerateJob:
    text = " ".join(f"t{rng.randrange(vocab)}" for _ in range(words))
    prompt = ChatPrompt(messages=[{"role": "user", "content": text}])
    sampling = SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True)
    return GenerateJob(f"sb-{rng.random()}", prompt, sampling, stream=True)


async def first_chunk_s(service: ModelService, job: GenerateJob, sent: float) -> float:
    first = None
    async for chunk in service.generate(job):
        if first is None and chunk.num_tokens:
            first = time.perf_counter() - sent
    return first if first is not None else float("nan")


def burst_timeline(timeline: CoreTimeline, log: StartedLog, jobs: list[GenerateJob], ttfts: list[float],
                   p95: float, sent: float) -> dict:
    """The P95 request's phases and the steps that ran during the burst, in ms from the burst's start."""
    ms = lambda t: round(1e3 * (t - sent), 1)  # noqa: E731
    rid = jobs[ttfts.index(p95)].request_id
    phases = {"submitted": ms(log.started.get(rid, sent)), "engine_took": ms(timeline.added.get(rid, sent)),
              "first_token_step_ended": ms(timeline.first_token_step.get(rid, sent)), "first_chunk": ms(sent + p95)}
    last_step = max(timeline.first_token_step.get(j.request_id, sent) for j in jobs)
    steps = [{"start": ms(s.started), "ms": round(1e3 * (s.ended - s.started), 1), "waiting": s.waiting_before,
              "first_tokens": s.first_tokens} for s in timeline.steps if sent <= s.started <= last_step]
    return {"p95_request": phases, "engine_took_last": ms(max(timeline.added.get(j.request_id, sent) for j in jobs)),
            "steps": steps}


async def one_burst(service: ModelService, jobs: list[GenerateJob], log: StartedLog,
                    timeline: CoreTimeline | None = None) -> dict:
    gil, loop_lag, collections = StallMeter(), StallMeter(), GcTimer()
    gc.callbacks.append(collections)
    stop_thread, stop_loop = threading.Event(), asyncio.Event()
    sent = gil.origin = loop_lag.origin = time.perf_counter()
    thread = threading.Thread(target=gil_meter, args=(gil, stop_thread), daemon=True)
    thread.start()
    lag_task = asyncio.create_task(loop_meter(loop_lag, stop_loop))
    ttfts = await asyncio.gather(*(first_chunk_s(service, job, sent) for job in jobs))
    stop_thread.set(), stop_loop.set()
    thread.join()
    await lag_task
    gc.callbacks.remove(collections)
    started = sorted(1e3 * (log.started[j.request_id] - sent) for j in jobs if j.request_id in log.started)
    p95 = p95_nearest_rank(ttfts)
    timed = burst_timeline(timeline, log, jobs, ttfts, p95, sent) if timeline is not None else None
    return {
        "ttft_p95_ms": round(1e3 * p95, 1),
        "ttft_ms": [round(1e3 * t, 1) for t in sorted(ttfts)],
        "submitted_ms": [round(t, 1) for t in started],
        "gil": gil.summary(), "event_loop": loop_lag.summary(), "gc": collections.summary(), "timeline": timed,
    }


async def run(args: argparse.Namespace) -> dict:
    model = make_random_model(tempfile.mkdtemp(prefix="orchard-sb-"), args.random_shape)
    config = ModelConfig(model_path=str(model), model_id="m", cb_completion_batch_size=128,
                         prefill_warmup_seconds=args.warmup_seconds)
    log = StartedLog()
    logging.getLogger("ray.serve.orchard").addHandler(log)
    logging.getLogger("ray.serve.orchard").setLevel(logging.INFO)
    timeline = CoreTimeline() if args.engine_thread else None
    if timeline is not None:
        config = config.model_copy(update={"engine_process": False})
        service = ModelService(config, lambda c: AsyncEngine(lambda: build_timed_core(core_spec(c), timeline)))
    else:
        service = ModelService(config)
    await service.start()
    if args.gc_freeze:
        gc.freeze()  # what the model process holds after start-up is never collected again
    vocab = min(1000, json.loads((model / "config.json").read_text())["vocab_size"] - 16)  # words "t0".."tN"
    rng = random.Random(0)
    job = lambda: make_job(rng, args.prompt_words, args.gen_tokens, vocab)  # noqa: E731
    try:
        await one_burst(service, [job() for _ in range(args.burst)], log)  # first-use costs
        report: dict = {"shape": args.random_shape, "burst": args.burst, "prompt_words": args.prompt_words, "bursts": []}
        for _ in range(args.bursts):
            lone = [await first_chunk_s(service, j, time.perf_counter()) for j in [job() for _ in range(3)]]
            burst = await one_burst(service, [job() for _ in range(args.burst)], log, timeline)
            burst["lone_ttft_ms"] = round(1e3 * statistics.median(lone), 1)
            burst["ratio"] = round(burst["ttft_p95_ms"] / burst["lone_ttft_ms"], 2)
            report["bursts"].append(burst)
            print(f"lone {burst['lone_ttft_ms']} ms, P95 {burst['ttft_p95_ms']} ms ({burst['ratio']}x); submitted "
                  f"{burst['submitted_ms'][0]}..{burst['submitted_ms'][-1]} ms; GIL stalls {burst['gil']}; "
                  f"loop stalls {burst['event_loop']}; gc {burst['gc']}", flush=True)
            if timeline is not None:
                print(f"  timeline: {json.dumps(burst['timeline'])}", flush=True)
        return report
    finally:
        await service.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--random-shape", default="tiny")
    p.add_argument("--burst", type=int, default=32)
    p.add_argument("--bursts", type=int, default=3)
    p.add_argument("--prompt-words", type=int, default=512)
    p.add_argument("--gen-tokens", type=int, default=32)
    p.add_argument("--warmup-seconds", type=float, default=30.0)
    p.add_argument("--engine-thread", action="store_true", help="the engine on a thread here, timed (bench.timed_core)")
    p.add_argument("--gc-freeze", action="store_true", help="gc.freeze() once the service has started")
    p.add_argument("--json")
    args = p.parse_args()
    report = asyncio.run(run(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
