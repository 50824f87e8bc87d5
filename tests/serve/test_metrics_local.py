"""GET /metrics after a known workload, parsed with prometheus_client's parser: in-process (no Ray)."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from deployments.config import ModelConfig
from deployments.ingress.auth import ApiKeys
from deployments.metrics.families import ALL_SPECS, MetricKind
from tests.serve.local_stack import local_stack, send_streaming, wait_for

# Long enough to fill two prefix-cache blocks (32 tokens each): the repeats read them from the cache.
PROMPT = " ".join(f"t{i}" for i in range(70))
CHAT = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 5, "temperature": 0}
MODEL = "alpha"


class Scrape:
    """One /metrics page, parsed by prometheus_client: values by sample name and labels (model_name: MODEL)."""

    def __init__(self, text: str) -> None:
        self.families = {family.name: family for family in text_string_to_metric_families(text)}
        self.values = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in self.families.values() for s in family.samples
        }

    def get(self, sample: str, **labels: str) -> float | None:
        return self.values.get((sample, tuple(sorted({"model_name": MODEL, **labels}.items()))))

    def __getitem__(self, sample: str) -> float:
        value = self.get(sample)
        assert value is not None, f"no sample {sample}"
        return value


async def _scrape(http) -> Scrape:
    page = await http.get("/metrics")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/plain; version=0.0.4")
    return Scrape(page.text)


async def _scrape_when_idle(http) -> Scrape:
    """The engine posts its levels every 0.2 s while it works: scrape once it has posted its idle ones."""

    async def idle() -> Scrape | None:
        scrape = await _scrape(http)
        return scrape if scrape.get("orchard:num_requests_running") == 0 else None

    return await wait_for(idle)


def _stream_usage(text: str) -> dict:
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    return next(e["usage"] for e in events if e.get("usage"))


async def _workload(http) -> list[dict]:
    """2 chat completions, 1 streamed chat completion, 1 completion, 1 completion the model refuses: the usages."""
    usages = []
    for _ in range(2):
        reply = await http.post("/v1/chat/completions", json={"model": MODEL, **CHAT})
        assert reply.status_code == 200
        usages.append(reply.json()["usage"])
    streamed = await http.post("/v1/chat/completions", json={
        "model": MODEL, **CHAT, "stream": True, "stream_options": {"include_usage": True},
    })
    assert streamed.status_code == 200
    usages.append(_stream_usage(streamed.text))
    completion = await http.post("/v1/completions", json={"model": MODEL, "prompt": "t3 t4 t5", "max_tokens": 4})
    assert completion.status_code == 200
    usages.append(completion.json()["usage"])
    refused = await http.post("/v1/completions", json={"model": MODEL, "prompt": [100000], "max_tokens": 4})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt", refused.text
    return usages


def test_metrics_count_a_known_workload(tiny_models):
    async def scenario():
        async with local_stack([ModelConfig(model_id=MODEL, model_path=str(tiny_models.alpha))]) as stack:
            usages = await _workload(stack.http)
            scrape = await _scrape_when_idle(stack.http)
            _check_workload(scrape, usages)
            await _abort_a_stream(stack, scrape)

    asyncio.run(scenario())


def _check_workload(scrape: Scrape, usages: list[dict]) -> None:
    requests = "orchard:requests_total"
    assert scrape.get(requests, api="chat", status="finished") == 3
    assert scrape.get(requests, api="completions", status="finished") == 1
    assert scrape.get(requests, api="completions", status="error") == 1
    assert len(scrape.families["orchard:requests"].samples) == 3  # no other API, no other outcome
    assert scrape.families["orchard:requests"].type == "counter"

    reasons = {s.labels["finished_reason"]: s.value for s in scrape.families["orchard:request_success"].samples}
    assert sum(reasons.values()) == 4 and set(reasons) <= {"stop", "length"}
    assert scrape["orchard:prompt_tokens_total"] == sum(u["prompt_tokens"] for u in usages)
    generated = sum(u["completion_tokens"] for u in usages)
    assert scrape["orchard:generation_tokens_total"] == generated

    # One observation per request that produced a token (the refused one never reached the engine).
    for histogram in ("orchard:time_to_first_token_seconds", "orchard:e2e_request_latency_seconds",
                      "orchard:request_queue_time_seconds"):
        assert scrape.families[histogram].type == "histogram"
        assert scrape[histogram + "_count"] == 4, histogram
        assert scrape.get(histogram + "_bucket", le="+Inf") == 4, histogram
        assert scrape[histogram + "_sum"] > 0, histogram
    # One per token after a request's first, but tokens that arrive together with the first have none.
    assert 0 < scrape["orchard:inter_token_latency_seconds_count"] <= generated - 4

    assert scrape["orchard:num_requests_waiting"] == 0
    # The KV budget as set at load (device memory less what is loaded): this light load preempts nobody.
    assert scrape["orchard:kv_cache_budget_bytes"] > 0
    assert scrape["orchard:num_preemptions_total"] == 0 and scrape["orchard:num_requests_preempted"] == 0
    assert scrape.families["orchard:num_preemptions"].type == "counter"
    assert scrape["orchard:engine_restarts_total"] == 0
    assert scrape.get("orchard:memory_bytes", kind="rss") > 0
    # The 2nd and 3rd chat prompts read two 32-token blocks from the cache, as their usage says.
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usages]
    assert cached == [0, 64, 64, 0]
    assert scrape["orchard:prefix_cache_hit_tokens_total"] == 128
    assert scrape.get("orchard:prefix_cache_lookups_total", result="hit") == 2
    assert scrape.get("orchard:prefix_cache_lookups_total", result="miss") == 2


async def _abort_a_stream(stack, before: Scrape) -> None:
    """An Anthropic stream the client leaves after its first text: counted aborted, by the ingress and the model."""
    body = {"model": MODEL, "max_tokens": 2000, "stream": True, "messages": [{"role": "user", "content": "t9"}]}
    input_tokens = None
    async for message in send_streaming(stack.app, "/v1/messages", body):
        if "message_start" in message.body:
            start = message.body.split("data: ", 1)[1].split("\n", 1)[0]
            input_tokens = json.loads(start)["message"]["usage"]["input_tokens"]
        if "content_block_delta" in message.body:
            break
    assert input_tokens is not None

    async def aborted() -> Scrape | None:
        scrape = await _scrape_when_idle(stack.http)
        return scrape if scrape.get("orchard:request_success_total", finished_reason="abort") == 1 else None

    after = await wait_for(aborted)
    assert after.get("orchard:requests_total", api="messages", status="aborted") == 1
    assert after.get("orchard:requests_total", api="messages", status="finished") is None
    assert after["orchard:prompt_tokens_total"] - before["orchard:prompt_tokens_total"] == input_tokens
    assert 1 <= after["orchard:generation_tokens_total"] - before["orchard:generation_tokens_total"] < 2000


def test_metrics_need_no_key(tiny_models):
    """Scrapers read /metrics without a key, as load balancers read /health; the API still needs one."""

    async def scenario():
        config = ModelConfig(model_id=MODEL, model_path=str(tiny_models.alpha))
        async with local_stack([config], keys=ApiKeys(["secret"])) as stack:
            assert (await stack.http.post("/v1/chat/completions", json={"model": MODEL, **CHAT})).status_code == 401
            scrape = await _scrape(stack.http)
            assert scrape.get("orchard:num_requests_running") == 0
            assert "orchard:requests" not in scrape.families

    asyncio.run(scenario())


def test_dashboard_reads_only_exported_names():
    """Every series docs/grafana/orchard.json queries is one Orchard exports (a histogram's through its _bucket)."""
    dashboard = (Path(__file__).resolve().parents[2] / "docs" / "grafana" / "orchard.json").read_text()
    queried = set(re.findall(r"\$\{prefix\}([a-z0-9_]+)", dashboard))
    exported = {spec.name for spec in ALL_SPECS if spec.kind is not MetricKind.HISTOGRAM}
    exported |= {spec.name + "_bucket" for spec in ALL_SPECS if spec.kind is MetricKind.HISTOGRAM}
    assert queried and queried <= exported, queried - exported
    assert json.loads(dashboard)["panels"]
