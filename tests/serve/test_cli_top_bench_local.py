"""`orchard top` and `orchard bench` against the in-process stack served on a real loopback port (uvicorn on the
test's event loop; the commands run in a thread, as from another terminal)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import httpx
import pytest
import uvicorn

from deployments.cli.main import main
from deployments.cli.top_stats import Histogram, model_rows, scrape
from deployments.config import ModelConfig
from tests.support.serving import free_port
from tests.serve.local_stack import local_stack, wait_for

MODEL = "alpha"
# Long enough to fill two prefix-cache blocks (32 tokens each): the second request reads them from the cache.
PROMPT = " ".join(f"t{i}" for i in range(70))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def wide_terminal(monkeypatch):
    monkeypatch.setenv("COLUMNS", "220")  # rich wraps a table to the console's width (80 when not a terminal)


@contextlib.asynccontextmanager
async def served(tiny_models) -> AsyncIterator[str]:
    """The stack on 127.0.0.1:<free port>; yields its URL."""
    async with local_stack([ModelConfig(model_id=MODEL, model_path=str(tiny_models.alpha))]) as stack:
        server = uvicorn.Server(uvicorn.Config(stack.app, host="127.0.0.1", port=free_port(), log_level="warning",
                                               lifespan="off"))
        serving = asyncio.create_task(server.serve())

        async def started() -> bool:
            return server.started

        await wait_for(started)
        try:
            yield f"http://127.0.0.1:{server.config.port}"
        finally:
            server.should_exit = True
            await serving


async def orchard(*argv: str) -> int:
    return await asyncio.to_thread(main, list(argv))


def test_histogram_quantile_interpolates_as_prometheus():
    histogram = Histogram([0.1, 0.2, float("inf")], [1.0, 3.0, 4.0])
    assert histogram.quantile(0.5) == pytest.approx(0.15)  # rank 2: halfway through the (0.1, 0.2] bucket
    assert histogram.quantile(0.99) == 0.2  # in +Inf: the highest finite bound
    assert histogram.minus(Histogram([0.1, 0.2, float("inf")], [1.0, 1.0, 1.0])).cumulative == [0.0, 2.0, 3.0]
    assert Histogram().quantile(0.5) is None


def test_top_reads_a_workload_and_renders_a_frame(tiny_models, capsys):
    async def scenario():
        async with served(tiny_models) as url:
            with httpx.Client(timeout=10) as http:
                before = await asyncio.to_thread(scrape, http, url)
                generated = 0
                async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                    for _ in range(2):  # the same prompt twice: one prefix-cache miss, one hit
                        reply = await client.post("/v1/chat/completions", json={
                            "model": MODEL, "max_tokens": 5, "temperature": 0,
                            "messages": [{"role": "user", "content": PROMPT}]})
                        assert reply.status_code == 200, reply.text
                        generated += reply.json()["usage"]["completion_tokens"]
                after = await asyncio.to_thread(scrape, http, url)
            [row] = model_rows(before, after)
            assert (row.model_id, row.status, row.error, row.errors, row.engine_restarts) == (MODEL, "running", None,
                                                                                              0, 0)
            assert row.tokens_per_s * (after.at - before.at) == pytest.approx(generated)
            assert row.ttft_window and row.itl_window and 0 < row.ttft_p50 <= row.ttft_p95 <= row.ttft_p99
            assert row.prefix_hit_rate == 0.5
            assert row.rss_bytes > 0 and row.mlx_active_bytes > 0

            capsys.readouterr()
            assert await orchard("top", "--url", url, "--once", "--interval", "0.2") == 0
            frame = capsys.readouterr().out
            assert f"orchard top  {url}  health ok  1 model(s)" in frame
            line = next(line for line in frame.splitlines() if line.startswith(MODEL))
            assert line.split()[:4] == [MODEL, "running", "0", "0"]  # idle now: nothing running or waiting
            assert "50%" in line  # the hit rate since the start (no lookup in the frame's window)

    asyncio.run(scenario())


def test_top_and_bench_say_when_no_server_answers(capsys):
    url = f"http://127.0.0.1:{free_port()}"
    assert main(["top", "--url", url, "--once"]) == 1
    assert f"no Orchard server answers at {url}" in capsys.readouterr().out
    assert main(["bench", "--url", url]) == 1
    assert f"no Orchard server answers at {url}" in capsys.readouterr().out
    # A server elsewhere is loaded only with --allow-remote (refused before any request).
    assert main(["bench", "--url", "http://192.0.2.1:8000"]) == 1
    assert "http://192.0.2.1:8000 is not on this machine" in capsys.readouterr().out


def test_bench_against_a_second_server_writes_json_and_plots(tiny_models, tmp_path, capsys):
    out = tmp_path / "results"

    async def scenario():
        async with served(tiny_models) as url:
            assert await orchard("bench", "--url", url, "--model", "nope") == 1
            assert f"unknown model 'nope' at {url}; it serves: {MODEL}" in capsys.readouterr().out
            # Both "servers" are the one test server: its two runs stand in for two servers.
            rc = await orchard("bench", "--url", url, "--against", f"{url}/v1", "--names", "first,second",
                               "--concurrency", "1,2", "--requests-per-stream", "1", "--gen-tokens", "8",
                               "--duration", "60", "--out", str(out))
            assert rc == 0, capsys.readouterr().out

    asyncio.run(scenario())
    report = json.loads((out / "bench.json").read_text())
    assert list(report["servers"]) == ["first", "second"]
    assert report["targets"]["second"]["model"] == MODEL
    for suite in report["servers"].values():
        levels = [(level["workload"], level["concurrency"], level["requests"], level["ok"], level["errors"])
                  for level in suite["levels"]]
        assert levels == [("mixed", 1, 1, 1, 0), ("mixed", 2, 2, 2, 0)]
        assert all(level["system_tok_s"] > 0 and level["ttft_p95_s"] > 0 for level in suite["levels"])
    for name in ("throughput", "ttft_p95", "itl_p50"):
        assert (out / f"{name}.png").read_bytes()[:8] == PNG_MAGIC
    printed = capsys.readouterr().out
    assert "first tok/s" in printed and "second tok/s" in printed
