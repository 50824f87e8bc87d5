"""The serving workloads: closed-loop sweeps (mixed / same / uniform), a long prompt among running streams, a burst.

Each function is bounded: a soft deadline stops new requests, a hard deadline cancels what is
still running (recorded as cancelled, not as errors), so a sweep always ends on time.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Optional

import numpy as np

from deployments.cli.loadgen.client import RequestRecord, RequestSpec, StreamClient, make_spec
from deployments.chat.synthetic_images import image_data_url, image_tokens
from deployments.cli.loadgen.stats import (
    BurstResult,
    LevelResult,
    LongPromptResult,
    summarize_burst,
    engine_window,
    summarize_level,
    summarize_long,
)

# Vision (bench.serving.vision_compare): `image` = one image + a question per request; `text_only` = text
# prompts of about an image request's tokens; `image_mix` = half of each.
VISION_WORKLOADS = ("image", "image_mix", "text_only")
SWEEP_WORKLOADS = ("mixed", "uniform", "same") + VISION_WORKLOADS
SCENARIO_WORKLOADS = ("long", "burst", "batch")
WORKLOADS = SWEEP_WORKLOADS + SCENARIO_WORKLOADS
WORKLOAD_IDS = {name: i for i, name in enumerate(WORKLOADS)}  # seeds prompts per workload
WARMUP_ROUND = 10_000  # the vision warm-ups' round index: their images and prompts are never measured ones
LONG_READY_TOKENS = 8  # background streams count as running once each has this many tokens
LONG_GRACE_S = 0.1  # a stall ends with the read right after the long prompt's first token (~ one coalescing window)
LONG_BASELINE_S = 1.0  # decode-only time before the long prompt is sent
LONG_TAIL_S = 0.5  # background streams kept open after the long prompt finished


@dataclass
class LoadSettings:
    """Everything that shapes the requests; identical for every server in one comparison."""

    levels: list[int]
    workloads: list[str]
    vocab_size: int
    gen_tokens: int = 128
    prompt_tokens: int = 128  # `uniform` (matches bench.engine_throughput's --prompt-tokens)
    mixed_min_tokens: int = 64
    mixed_max_tokens: int = 1024
    same_prompt_tokens: int = 512
    long_prompt_tokens: int = 8192
    long_background: int = 16
    long_background_prompt_tokens: int = 128
    long_background_max_tokens: int = 2048  # never reached: the streams are closed after the long prompt
    long_gen_tokens: int = 8
    burst_size: int = 32
    burst_prompt_tokens: int = 512
    burst_gen_tokens: int = 32
    lone_repeats: int = 3
    requests_per_worker: int = 2
    requests_per_worker_high: int = 1
    high_from: int = 32  # levels >= this use requests_per_worker_high
    # Between request starts of one wave: at 0-1 ms mlx_lm.server's accept backlog (5) overflows at 128 streams
    # (SYN retries: seconds of TTFT). The engine baseline replays the same arrival spacing.
    stagger_ms: float = 2.0
    # The burst is sent at once, as its acceptance point says ("32 simultaneous prompts").
    burst_stagger_ms: float = 0.0
    warmup_tokens: int = 16  # 0: no warm-up
    seed: int = 0
    request_timeout_s: float = 300.0
    image_width: int = 672
    image_height: int = 672
    image_format: str = "jpeg"
    question_tokens: int = 64  # the text beside each image
    text_only_tokens: int = 0  # text_only prompts; 0: the image's tokens (Qwen2.5-VL: one per 28x28 px) + the question
    batch_lines: int = 2000  # the batch workload's Batches API job (uniform prompts), beside batch_streams streams
    batch_streams: int = 8

    def rpw(self, concurrency: int) -> int:
        return self.requests_per_worker_high if concurrency >= self.high_from else self.requests_per_worker

    def text_only_words(self) -> int:
        return self.text_only_tokens or image_tokens(self.image_width, self.image_height) + self.question_tokens


def _rng(settings: LoadSettings, workload: str, *extra: int) -> np.random.Generator:
    return np.random.default_rng([settings.seed, WORKLOAD_IDS.get(workload, 99), *extra])


def sweep_specs(settings: LoadSettings, workload: str, concurrency: int) -> list[list[RequestSpec]]:
    """Per worker, the requests it sends back to back. Prompts differ per level (no cross-level cache hits),
    except `same`, where every request of every level carries one prompt (prefix reuse)."""
    if workload in VISION_WORKLOADS:
        return vision_specs(settings, workload, concurrency)
    rng = _rng(settings, workload, concurrency)
    vocab, gen, n = settings.vocab_size, settings.gen_tokens, settings.rpw(concurrency)
    if workload == "same":
        shared = make_spec(_rng(settings, workload), settings.same_prompt_tokens, gen, vocab)
        return [[shared] * n for _ in range(concurrency)]
    if workload == "uniform":
        return [[make_spec(rng, settings.prompt_tokens, gen, vocab) for _ in range(n)] for _ in range(concurrency)]
    if workload == "mixed":  # log-uniform lengths: many short prompts, some long ones
        lo, hi = math.log(settings.mixed_min_tokens), math.log(settings.mixed_max_tokens)
        lengths = np.exp(rng.uniform(lo, hi, size=(concurrency, n))).astype(int)
        return [[make_spec(rng, int(k), gen, vocab) for k in row] for row in lengths]
    raise ValueError(f"unknown sweep workload {workload!r}")


def vision_specs(
    settings: LoadSettings, workload: str, concurrency: int, round_index: int = 0, max_tokens: Optional[int] = None
) -> list[list[RequestSpec]]:
    """Per worker, its requests: `image` all with an image, `text_only` none, `image_mix` alternating (worker +
    request index even: image). Every image is a new synthetic picture (seeded by level, round, worker and
    request) and every question new, so no request repeats another's prefix; both servers get the same ones."""
    rng = _rng(settings, workload, concurrency, round_index)
    gen = max_tokens or settings.gen_tokens
    rows = []
    for worker in range(concurrency):
        row = []
        for index in range(settings.rpw(concurrency)):
            with_image = workload == "image" or (workload == "image_mix" and (worker + index) % 2 == 0)
            if not with_image:
                row.append(make_spec(rng, settings.text_only_words(), gen, settings.vocab_size))
                continue
            spec = make_spec(rng, settings.question_tokens, gen, settings.vocab_size)
            seed = (settings.seed, WORKLOAD_IDS[workload], concurrency, round_index, worker, index)
            spec.image_url = image_data_url(settings.image_width, settings.image_height, seed, settings.image_format)
            row.append(spec)
        rows.append(row)
    return rows


# ---- running groups of requests
async def run_wave(
    client: StreamClient, specs: list[RequestSpec], stagger_s: float, hard: float
) -> tuple[list[RequestRecord], bool]:
    """All specs at once (start i delayed by i * stagger_s); returns records and whether the hard deadline cut it."""
    return await closed_loop(client, [[s] for s in specs], soft=0.0, hard=hard, stagger_s=stagger_s)


async def closed_loop(
    client: StreamClient, worker_specs: list[list[RequestSpec]], soft: float, hard: float, stagger_s: float
) -> tuple[list[RequestRecord], bool]:
    """Each worker sends its requests back to back; none starts after `soft` (but each worker's first does)."""
    records: list[RequestRecord] = []

    async def worker(index: int, specs: list[RequestSpec]) -> None:
        await asyncio.sleep(index * stagger_s)
        for i, spec in enumerate(specs):
            if i > 0 and time.perf_counter() >= soft:
                return
            record = RequestRecord(time.perf_counter(), spec.prompt_words, spec.max_tokens)
            records.append(record)
            await client.stream(spec, record)

    tasks = [asyncio.create_task(worker(i, specs)) for i, specs in enumerate(worker_specs)]
    cut = await _wait_or_cancel(tasks, hard)
    return records, cut


async def _wait_or_cancel(tasks: list[asyncio.Task], hard: float) -> bool:
    _done, pending = await asyncio.wait(tasks, timeout=max(0.0, hard - time.perf_counter()))
    for task in pending:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return bool(pending)


async def warm_up(
    client: StreamClient, settings: LoadSettings, concurrency: int, hard: float, workload: str = ""
) -> list[RequestRecord]:
    """Short requests at this concurrency, so kernel compilation for new batch shapes is not timed (a vision
    workload's own requests, with images where it has them)."""
    if settings.warmup_tokens <= 0:
        return []
    if workload in VISION_WORKLOADS:
        rows = vision_specs(settings, workload, concurrency, WARMUP_ROUND, settings.warmup_tokens)
        specs = [row[0] for row in rows]
    else:
        rng = np.random.default_rng([settings.seed, 1000 + concurrency])
        specs = [make_spec(rng, 32, settings.warmup_tokens, settings.vocab_size) for _ in range(concurrency)]
    records, _ = await run_wave(client, specs, settings.stagger_ms / 1e3, hard)
    return records


async def warm_up_prompts(client: StreamClient, settings: LoadSettings, hard: float) -> list[RequestRecord]:
    """One request per prompt size the suite will use (prefill shapes), long prompt included if asked for."""
    if settings.warmup_tokens <= 0:
        return []
    sizes = {settings.mixed_min_tokens, settings.mixed_max_tokens, settings.prompt_tokens, settings.burst_prompt_tokens}
    if "long" in settings.workloads:
        sizes.add(settings.long_prompt_tokens)
    rng = np.random.default_rng([settings.seed, 2000])
    specs = [make_spec(rng, k, settings.warmup_tokens, settings.vocab_size) for k in sorted(sizes)]
    if set(settings.workloads) & set(VISION_WORKLOADS):  # the vision tower's first image, a text_only prompt
        specs.append(vision_specs(settings, "image", 1, WARMUP_ROUND + 1, settings.warmup_tokens)[0][0])
        specs.append(make_spec(rng, settings.text_only_words(), settings.warmup_tokens, settings.vocab_size))
    records, _ = await closed_loop(client, [specs], soft=float("inf"), hard=hard, stagger_s=0.0)
    return records


# ---- the workloads
async def run_sweep_level(
    client: StreamClient, settings: LoadSettings, workload: str, concurrency: int, soft: float, hard: float,
    round_index: int = 0,
) -> LevelResult:
    """One closed-loop level; a vision workload's `round_index` > 0 gives it new images and prompts (repeats)."""
    if round_index and workload in VISION_WORKLOADS:
        specs = vision_specs(settings, workload, concurrency, round_index)
    else:
        specs = sweep_specs(settings, workload, concurrency)
    before = await client.engine_counters()
    records, cut = await closed_loop(client, specs, soft, hard, settings.stagger_ms / 1e3)
    after = await client.engine_counters()
    planned = sum(len(s) for s in specs)
    note = ""
    if len(records) < planned:
        note = f"time budget: {len(records)} of {planned} requests"
    if cut:
        note = (note + "; " if note else "") + "hard deadline cancelled in-flight requests"
    level = summarize_level(workload, concurrency, records, note)
    level.engine = engine_window(before, after)
    return level


async def run_long(client: StreamClient, settings: LoadSettings, hard: float) -> LongPromptResult:
    """`long_background` streams decode; once all run (and a decode-only baseline is recorded), one long
    prompt arrives; the streams are closed shortly after its first token."""
    rng = _rng(settings, "long")
    vocab, stagger = settings.vocab_size, settings.stagger_ms / 1e3
    bg_specs = [
        make_spec(rng, settings.long_background_prompt_tokens, settings.long_background_max_tokens, vocab)
        for _ in range(settings.long_background)
    ]
    bg = [RequestRecord(time.perf_counter(), s.prompt_words, s.max_tokens) for s in bg_specs]
    tasks = [asyncio.create_task(_delayed(i * stagger, client.stream, s, r)) for i, (s, r) in enumerate(zip(bg_specs, bg))]
    long_record: Optional[RequestRecord] = None
    steady_from, notes = float("inf"), []
    try:
        ready = await _poll(lambda: all(r.tokens_so_far() >= LONG_READY_TOKENS or r.end_at for r in bg), hard)
        running = sum(1 for r in bg if not r.end_at)
        if not ready or running < len(bg) / 2:
            notes.append(f"background streams did not start: {running} of {len(bg)} running")
            return summarize_long(bg, None, steady_from, settings.long_prompt_tokens, LONG_GRACE_S, "; ".join(notes))
        steady_from = time.perf_counter()
        await _sleep_until(min(hard, steady_from + LONG_BASELINE_S))  # decode-only ITL: the median to compare with
        long_spec = make_spec(rng, settings.long_prompt_tokens, settings.long_gen_tokens, vocab)
        long_record = RequestRecord(time.perf_counter(), long_spec.prompt_words, long_spec.max_tokens)
        if await _wait_or_cancel([asyncio.create_task(client.stream(long_spec, long_record))], hard):
            notes.append("long prompt cut by the hard deadline")
        await _sleep_until(min(hard, time.perf_counter() + LONG_TAIL_S))  # the streams' recovery
        ended = sum(1 for r in bg if r.end_at)  # EOS where the server cannot ignore it, or an error
        if ended:
            notes.append(f"{ended} of {len(bg)} background streams ended early")
    finally:
        await _wait_or_cancel(tasks, time.perf_counter())  # close the background streams now
    return summarize_long(bg, long_record, steady_from, settings.long_prompt_tokens, LONG_GRACE_S, "; ".join(notes))


async def run_burst(client: StreamClient, settings: LoadSettings, hard: float) -> BurstResult:
    """A lone request's TTFT (median of a few, sent one after another), then `burst_size` at once
    (burst_stagger_ms apart)."""
    rng = _rng(settings, "burst")
    vocab, words, gen = settings.vocab_size, settings.burst_prompt_tokens, settings.burst_gen_tokens
    lone_specs = [make_spec(rng, words, gen, vocab) for _ in range(settings.lone_repeats)]
    lone, _ = await closed_loop(client, [lone_specs], soft=float("inf"), hard=hard, stagger_s=0.0)
    burst_specs = [make_spec(rng, words, gen, vocab) for _ in range(settings.burst_size)]
    burst, cut = await run_wave(client, burst_specs, settings.burst_stagger_ms / 1e3, hard)
    return summarize_burst(lone, burst, settings.burst_stagger_ms, note="hard deadline cancelled requests" if cut else "")


async def _delayed(delay_s: float, fn: Callable[..., Awaitable], *args) -> None:
    await asyncio.sleep(delay_s)
    await fn(*args)


async def _sleep_until(when: float) -> None:
    await asyncio.sleep(max(0.0, when - time.perf_counter()))


async def _poll(condition: Callable[[], bool], hard: float, interval_s: float = 0.005) -> bool:
    while not condition():
        if time.perf_counter() >= hard:
            return False
        await asyncio.sleep(interval_s)
    return True
