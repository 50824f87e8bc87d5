"""The `batch` workload (issue 58): a Batches API job beside interactive streams.

Interactive streams alone for a while (the uniform workload at `batch_streams`), then a JSONL of `batch_lines`
uniform chat requests uploaded (/v1/files) and run (/v1/batches); while it runs, the same interactive streams
again. Reported: the batch's generated tokens per second (its output file's usage over the time from creation to
completion, polled), and interactive TTFT P95 during it over alone. A server without the Batches API
(mlx_lm.server) gets a note and no figures.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, replace
from typing import Any, Optional

import aiohttp
import numpy as np

from deployments.cli.loadgen.client import StreamClient, make_spec
from deployments.cli.loadgen.stats import LevelResult
from deployments.cli.loadgen.workloads import LoadSettings, run_sweep_level

POLL_S = 0.5
INTERACTIVE_SHARE = 0.25  # of the unit's budget: each interactive window (alone, during the batch)


@dataclass
class BatchLoadResult:
    lines: int
    streams: int  # interactive streams beside it
    status: str = ""
    completed: int = 0
    failed: int = 0
    wall_s: float = 0.0  # created -> completed, as polled
    generated_tokens: int = 0
    tok_s: float = 0.0
    interactive_alone: Optional[LevelResult] = None
    interactive_during: Optional[LevelResult] = None
    ttft_p95_ratio: float = float("nan")  # during / alone
    note: str = ""


def batch_lines(client: StreamClient, settings: LoadSettings, lines: int) -> bytes:
    """The job's JSONL: uniform prompts (the in-process engine baseline's shape), greedy, the target's extra body."""
    rng = np.random.default_rng([settings.seed, 5800])
    target, rows = client.target, []
    for i in range(lines):
        spec = make_spec(rng, settings.prompt_tokens, settings.gen_tokens, settings.vocab_size)
        body = {"model": target.model, "messages": [{"role": "user", "content": spec.prompt}],
                "max_tokens": spec.max_tokens, "temperature": 0.0, **target.extra_body}
        rows.append(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}))
    return ("\n".join(rows) + "\n").encode()


async def run_batch_load(client: StreamClient, settings: LoadSettings, hard: float) -> BatchLoadResult:
    result = BatchLoadResult(settings.batch_lines, settings.batch_streams)
    window = INTERACTIVE_SHARE * max(0.0, hard - time.perf_counter())
    # Prompts of the uniform workload's shape seeded apart (the sweep's own, and each other's): no prefix-cache hits.
    alone_prompts, during_prompts = (replace(settings, seed=settings.seed + k) for k in (101, 102))
    now = time.perf_counter()
    result.interactive_alone = await run_sweep_level(client, alone_prompts, "uniform", result.streams, now + window, hard)
    try:
        batch_id, created = await _create_batch(client, batch_lines(client, settings, result.lines))
    except (aiohttp.ClientError, ValueError, KeyError) as exc:
        result.note = f"no Batches API here: {exc}"[:300]
        return result
    now = time.perf_counter()
    result.interactive_during = await run_sweep_level(client, during_prompts, "uniform", result.streams, now + window, hard)
    ended_early = (await _batch(client, batch_id)).get("status") != "in_progress"
    batch = await _wait_done(client, batch_id, hard)
    result.status = batch.get("status", "")
    counts = batch.get("request_counts") or {}
    result.completed, result.failed = counts.get("completed", 0), counts.get("failed", 0)
    result.wall_s = time.perf_counter() - created
    if batch.get("output_file_id"):
        result.generated_tokens = await _generated_tokens(client, batch["output_file_id"])
        result.tok_s = result.generated_tokens / result.wall_s if result.wall_s > 0 else 0.0
    alone, during = result.interactive_alone.ttft_p95_s, result.interactive_during.ttft_p95_s
    result.ttft_p95_ratio = during / alone if alone else float("nan")
    if result.status != "completed":
        result.note = f"batch {result.status or 'unknown'} at the deadline"
    elif ended_early:
        result.note = "the batch ended inside the interactive window: more lines measure it better"
    return result


async def _create_batch(client: StreamClient, jsonl: bytes) -> tuple[str, float]:
    session, base = client.session, client.target.base_url
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", jsonl, filename="load.jsonl", content_type="application/jsonl")
    async with session.post(base + "/v1/files", data=form, headers=client.target.headers) as resp:
        if resp.status != 200:
            raise ValueError(f"POST /v1/files answered {resp.status}")
        file_id = (await resp.json())["id"]
    body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    created = time.perf_counter()
    async with session.post(base + "/v1/batches", json=body, headers=client.target.headers) as resp:
        if resp.status != 200:
            raise ValueError(f"POST /v1/batches answered {resp.status}")
        return (await resp.json())["id"], created


async def _batch(client: StreamClient, batch_id: str) -> dict[str, Any]:
    async with client.session.get(f"{client.target.base_url}/v1/batches/{batch_id}",
                                  headers=client.target.headers) as resp:
        return await resp.json()


async def _wait_done(client: StreamClient, batch_id: str, hard: float) -> dict[str, Any]:
    batch: dict[str, Any] = {}
    while time.perf_counter() < hard:
        batch = await _batch(client, batch_id)
        if batch.get("status") in ("completed", "failed", "cancelled", "expired"):
            return batch
        await asyncio.sleep(POLL_S)
    return batch


async def _generated_tokens(client: StreamClient, file_id: str) -> int:
    url = f"{client.target.base_url}/v1/files/{file_id}/content"
    async with client.session.get(url, headers=client.target.headers) as resp:
        text = await resp.text()
    total = 0
    for line in text.splitlines():
        if line.strip():
            body = (json.loads(line).get("response") or {}).get("body") or {}
            total += (body.get("usage") or {}).get("completion_tokens", 0)
    return total


__all__ = ["BatchLoadResult", "batch_lines", "run_batch_load"]
