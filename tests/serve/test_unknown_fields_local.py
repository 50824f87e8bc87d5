"""Forward-compatible parsing (issue 26): the top-level fields real clients send and Orchard does not use are
accepted, answered as without them, and counted in /v1/queue/stats; known fields keep their strict checks."""

from __future__ import annotations

import asyncio

from tests.serve.local_stack import local_stack
from tests.serve.test_ingress_local import MODEL, alpha, chat_body, sse_payloads  # noqa: F401 (alpha: a fixture)

# Sent by the OpenAI SDK / Codex / guidellm and by Claude Code 2.1 (issue 26's list); none changes the answer here.
OPENAI_EXTRAS = {
    "service_tier": "auto", "reasoning_effort": "low", "verbosity": "low", "prompt_cache_key": "k1",
    "safety_identifier": "u1", "prediction": {"type": "content", "content": "x"}, "web_search_options": {},
    "modalities": ["text"],
}
ANTHROPIC_EXTRAS = {"speed": "fast", "diagnostics": {"a": 1}, "betas": ["b1"], "inference_geo": "eu",
                    "output_config": {"effort": "medium"}}


def test_unknown_top_level_fields_are_ignored_and_counted_known_ones_still_checked(alpha):  # noqa: F811
    anthropic_body = {"model": MODEL, "max_tokens": 12, "temperature": 0, "messages": [{"role": "user", "content": "t1"}]}

    async def scenario():
        async with local_stack([alpha]) as stack:
            http = stack.http
            plain = (await http.post("/v1/chat/completions", json=chat_body())).json()
            extra = await http.post("/v1/chat/completions", json=chat_body(**OPENAI_EXTRAS))
            streamed = await http.post("/v1/chat/completions", json=chat_body(
                stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}
            ))
            messages = await http.post("/v1/messages", json={**anthropic_body, **ANTHROPIC_EXTRAS})
            counted = await http.post("/v1/messages/count_tokens", json={
                "model": MODEL, "messages": anthropic_body["messages"], **ANTHROPIC_EXTRAS
            })
            bad = await http.post("/v1/chat/completions", json=chat_body(temperature=3, service_tier="auto"))
            stats = (await http.get("/v1/queue/stats")).json()
            return plain, extra, streamed, messages, counted, bad, stats

    plain, extra, streamed, messages, counted, bad, stats = asyncio.run(scenario())
    assert extra.status_code == 200
    assert extra.json()["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
    events, done = sse_payloads(streamed.text)
    assert streamed.status_code == 200 and done and events[-1]["usage"]["completion_tokens"] == 12
    assert messages.status_code == 200 and messages.json()["usage"]["output_tokens"] == 12
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 0
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"
    ignored = stats["ignored_fields"]
    assert all(ignored.get(f"openai.{name}", 0) >= 1 for name in OPENAI_EXTRAS)
    assert all(ignored.get(f"anthropic.{name}", 0) >= 2 for name in ANTHROPIC_EXTRAS if name != "output_config")
    assert "anthropic.output_config" not in ignored  # a known field: its effort is read (and has no knob here)
