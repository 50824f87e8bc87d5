"""The vision comparison's probes beyond the level sweep (bench.serving.vision_compare): alternating text-only vs
half-image rounds at one level, the first image's TTFT on a fresh server, and an image asked about twice."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from deployments.chat.synthetic_images import image_data_url
from deployments.cli.loadgen.client import RequestSpec, StreamClient, Target, make_spec
from deployments.cli.loadgen.stats import LevelResult
from deployments.cli.loadgen.workloads import LoadSettings, run_sweep_level, warm_up


# ---- text_only vs image_mix rounds
@dataclass
class MixRound:
    round: int
    text_only: LevelResult
    image_mix: LevelResult
    ratio: float  # image_mix / text_only system tok/s


@dataclass
class MixResult:
    level: int
    rounds: list[MixRound] = field(default_factory=list)
    median_ratio: float = float("nan")
    note: str = ""


async def run_mix_rounds(target: Target, settings: LoadSettings, level: int, rounds: int, deadline: float) -> MixResult:
    """Warm both workloads at `level`, then `rounds` pairs, the order alternating (text first in round 1), each
    round with new images and prompts; the ratio per round and their median."""
    result = MixResult(level)
    async with StreamClient(target, settings.request_timeout_s) as client:
        for workload in ("text_only", "image_mix"):
            await warm_up(client, settings, level, hard=min(deadline, time.perf_counter() + 60), workload=workload)
        units_left = 2 * rounds
        for index in range(1, rounds + 1):
            order = ("text_only", "image_mix") if index % 2 else ("image_mix", "text_only")
            done: dict[str, LevelResult] = {}
            for workload in order:
                now = time.perf_counter()
                if deadline - now < 5.0:
                    result.note = f"time budget: {len(result.rounds)} of {rounds} rounds"
                    return result
                budget = (deadline - now) / units_left
                units_left -= 1
                soft, hard = now + budget, min(deadline, now + budget + max(10.0, budget))
                done[workload] = await run_sweep_level(client, settings, workload, level, soft, hard, round_index=index)
                print(f"  [{target.name}] {workload:<9} c={level:<3} round {index}: "
                      f"{done[workload].system_tok_s:8.1f} tok/s", flush=True)
            text, mix = done["text_only"].system_tok_s, done["image_mix"].system_tok_s
            ratio = mix / text if text else float("nan")
            result.rounds.append(MixRound(index, done["text_only"], done["image_mix"], ratio))
            result.median_ratio = statistics.median(r.ratio for r in result.rounds)
    return result


# ---- the first image on a fresh server; an image asked about twice
PROBE_TOKENS = 8  # TTFT probes: a few tokens each


def _image_spec(settings: LoadSettings, seed: tuple[int, ...], question_seed: int) -> RequestSpec:
    spec = make_spec(np.random.default_rng(question_seed), settings.question_tokens, PROBE_TOKENS, settings.vocab_size)
    spec.image_url = image_data_url(settings.image_width, settings.image_height, seed, settings.image_format)
    return spec


async def first_image_ttft(target: Target, settings: LoadSettings, round_index: int) -> Optional[float]:
    async with StreamClient(target, settings.request_timeout_s) as client:
        record = await client.stream(_image_spec(settings, (settings.seed, 77, round_index), 7700 + round_index))
    return None if record.error else record.ttft_s


async def repeated_image_ttfts(target: Target, settings: LoadSettings, pairs: int, round_index: int) -> dict[str, Any]:
    """Each pair: a new image with one question, then the same image with another; TTFTs and second / first. Then
    the second's question alone, without the image: the TTFT a repeated image cannot go under (`floor_ratio`)."""
    rows = []
    async with StreamClient(target, settings.request_timeout_s) as client:
        for pair in range(pairs):
            seed = (settings.seed, 78, round_index, pair)
            first = await client.stream(_image_spec(settings, seed, 7800 + 10 * round_index + pair))
            second_spec = _image_spec(settings, seed, 7900 + 10 * round_index + pair)
            second = await client.stream(second_spec)
            second_spec.image_url = None
            text = await client.stream(second_spec)
            if first.error or second.error or text.error or not first.ttft_s or None in (second.ttft_s, text.ttft_s):
                rows.append({"error": first.error or second.error or text.error or "no first token"})
                continue
            rows.append({"first_ttft_s": first.ttft_s, "second_ttft_s": second.ttft_s, "text_ttft_s": text.ttft_s,
                         "ratio": second.ttft_s / first.ttft_s, "floor_ratio": text.ttft_s / first.ttft_s})
    ratios = [r["ratio"] for r in rows if "ratio" in r]
    floors = [r["floor_ratio"] for r in rows if "floor_ratio" in r]
    return {"pairs": rows, "median_ratio": statistics.median(ratios) if ratios else None,
            "median_floor_ratio": statistics.median(floors) if floors else None}


__all__ = ["MixResult", "MixRound", "first_image_ttft", "repeated_image_ttfts", "run_mix_rounds"]
