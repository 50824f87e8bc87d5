"""Every request Claude Code 2.1.332 sent to a capturing stand-in (tests/fixtures/agents/claude_code), replayed with
its headers against the in-process stack on a tiny model with the default model's tokenizer and template (SmolLM2's
ChatML): each is answered 200 in Anthropic's exact shape, and count_tokens with the same bodies counts them. The tool
loop is replayed through Qwen3's template too, which renders the tools, tool_use / tool_result turns and <think>
(its ~12,000-token prompts take ~12 s to prefill here, hence the tool loop only)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter

from deployments.config import ModelConfig
from tests.serve.local_stack import local_stack
from tests.support.tiny_models import NARROW_ATTENTION, write_smollm2_tokenizer_model

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "agents" / "claude_code"
CAPTURED = sorted(FIXTURES.glob("*/*.json"))
QWEN3_TEMPLATE = Path(__file__).resolve().parents[1] / "support" / "qwen3_tools.jinja"
MODEL = "tiny/claude-code"
# Replayed as sent but for the model name and max_tokens: Claude Code asks for up to 128,000 tokens, which a tiny
# random model would spend; the room left is already enforced (clamp_max_tokens) for any value.
MAX_TOKENS = 6
# Transport headers of the capture, not the request's.
DROPPED_HEADERS = {"host", "content-length", "connection", "accept-encoding"}
EVENTS = TypeAdapter(RawMessageStreamEvent)


def tiny_model(tmp_path_factory, template: Path | None = None) -> ModelConfig:
    folder = write_smollm2_tokenizer_model(tmp_path_factory.mktemp("claude-code"), NARROW_ATTENTION, seed=2,
                                           scale=3.0)
    return ModelConfig(model_id=MODEL, model_path=str(folder), context_length=32768,
                       chat_template_file=None if template is None else str(template))


@pytest.fixture(scope="module")
def chatml(tmp_path_factory) -> ModelConfig:
    return tiny_model(tmp_path_factory)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> ModelConfig:
    return tiny_model(tmp_path_factory, QWEN3_TEMPLATE)


def captured(path: Path) -> tuple[str, dict[str, str], dict]:
    entry = json.loads(path.read_text())
    headers = {k: v for k, v in entry["headers"].items() if k not in DROPPED_HEADERS}
    body = {**entry["body"], "model": MODEL}
    if "max_tokens" in body:
        body["max_tokens"] = MAX_TOKENS
    return entry["path"], headers, body


def named_events(text: str) -> list[dict]:
    """Anthropic's SSE: `event: NAME` + `data: JSON` per event, the name matching the payload's type."""
    events = []
    for block in text.strip().split("\n\n"):
        name, data = block.split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert name == f"event: {payload['type']}"
        events.append(payload)
    return events


def assert_anthropic_event_order(events: list[dict]) -> None:
    """message_start, then whole content blocks (start, deltas, stop) at increasing indexes, message_delta,
    message_stop; pings anywhere after message_start."""
    assert events[0]["type"] == "message_start"
    kinds = [e["type"] for e in events if e["type"] != "ping"]
    assert kinds[-2:] == ["message_delta", "message_stop"], kinds
    open_index, next_index = None, 0
    for event in events[1:-2]:
        if event["type"] == "content_block_start":
            assert open_index is None and event["index"] == next_index, kinds
            open_index = event["index"]
        elif event["type"] in ("content_block_delta", "content_block_stop"):
            assert event["index"] == open_index, kinds
            if event["type"] == "content_block_stop":
                open_index, next_index = None, next_index + 1
        else:
            assert event["type"] == "ping", kinds
    assert open_index is None and next_index >= 1, kinds
    for event in events:
        if event["type"] == "ping":
            assert event == {"type": "ping"}
        else:
            EVENTS.validate_python(event)


def test_fixtures_hold_claude_codes_sequences():
    scenarios = {path.parent.name for path in CAPTURED}
    assert {"hello", "tool_loop", "custom_model_hello", "context_count_tokens", "minimal_hello"} <= scenarios
    assert all(json.loads(p.read_text())["headers"]["user-agent"].startswith("claude-cli/2.1.332") for p in CAPTURED)


async def replay(model: ModelConfig, paths: list[Path]) -> list[tuple[Path, object, object]]:
    """Each request as captured, and count_tokens with its body: (path, answer, count) in order."""
    async with local_stack([model]) as stack:
        replies = []
        for path in paths:
            url, headers, body = captured(path)
            answer = await stack.http.post(url, json=body, headers=headers, timeout=120)
            count_body = {k: v for k, v in body.items() if k not in ("max_tokens", "stream")}
            count = await stack.http.post("/v1/messages/count_tokens?beta=true", json=count_body, headers=headers,
                                          timeout=120)
            replies.append((path, answer, count))
        return replies


def assert_answered_and_counted(path: Path, answer, count) -> None:
    where = f"{path.parent.name}/{path.name}"
    assert answer.status_code == 200, (where, answer.text)
    assert count.status_code == 200, (where, count.text)
    input_tokens = count.json()["input_tokens"]
    assert isinstance(input_tokens, int) and input_tokens > 0, where
    url, _, body = captured(path)
    if url.startswith("/v1/messages/count_tokens"):
        assert answer.json() == {"input_tokens": input_tokens}, where
    elif body.get("stream"):
        assert answer.headers["content-type"].startswith("text/event-stream"), where
        events = named_events(answer.text)
        assert_anthropic_event_order(events)
        start, final = events[0]["message"], [e for e in events if e["type"] == "message_delta"][0]
        assert start["model"] == MODEL and start["role"] == "assistant", where
        assert final["delta"]["stop_reason"] in ("end_turn", "max_tokens", "tool_use"), where
        assert 1 <= final["usage"]["output_tokens"] <= MAX_TOKENS, where
    else:
        message = Message.model_validate(answer.json())
        assert message.content and 1 <= message.usage.output_tokens <= MAX_TOKENS, where


def test_every_captured_request_is_answered_and_counted(chatml):
    for path, answer, count in asyncio.run(replay(chatml, CAPTURED)):
        assert_answered_and_counted(path, answer, count)


def test_the_tool_loop_through_a_tools_template(qwen3):
    loop = sorted((FIXTURES / "tool_loop").glob("*.json"))
    replies = asyncio.run(replay(qwen3, loop))
    for path, answer, count in replies:
        assert_answered_and_counted(path, answer, count)
    first, second = (count.json()["input_tokens"] for _, _, count in replies)
    assert second > first > 10000  # the tools are in the prompt, and the tool_use / tool_result turn adds to it


def test_a_captured_body_with_its_own_max_tokens_is_answered(chatml):
    """The hello request exactly as sent (max_tokens 128000 is cut to the room the prompt leaves), not streamed so the
    answer's length can be read: the tiny model is given a short context so the reply stays short. Both contexts
    are too short for Claude Code's tools in full (8,222 tokens): both prompts describe them compactly."""
    path = FIXTURES / "hello" / "001_POST_v1_messages.json"
    url, headers, body = captured(path)
    body = {**body, "max_tokens": json.loads(path.read_text())["body"]["max_tokens"], "stream": False}

    async def scenario():
        async with local_stack([chatml.model_copy(update={"context_length": 16384})]) as stack:
            counted = await stack.http.post("/v1/messages/count_tokens", json={
                k: v for k, v in body.items() if k not in ("max_tokens", "stream")}, headers=headers)
            prompt_tokens = counted.json()["input_tokens"]
            short = chatml.model_copy(update={"context_length": prompt_tokens + 8})
        async with local_stack([short]) as stack:
            return prompt_tokens, await stack.http.post(url, json=body, headers=headers, timeout=120)

    prompt_tokens, answer = asyncio.run(scenario())
    assert body["max_tokens"] == 128000
    assert answer.status_code == 200, answer.text
    message = Message.model_validate(answer.json())
    assert message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) == prompt_tokens
    assert message.usage.output_tokens <= 8
    assert message.stop_reason in ("end_turn", "max_tokens")


def test_claude_code_shapes_over_http(chatml):
    """Structured output through output_config.format, and refusals in Anthropic's error shape naming the field."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    base = {"model": MODEL, "max_tokens": 40, "messages": [{"role": "user", "content": "Are you ok?"}]}
    png = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    refusals = {
        "tools.0.input_schema": {**base, "tools": [{"name": "f"}]},
        "tool_choice.name": {**base, "tools": [{"type": "web_search_20250305", "name": "web_search"}, {
            "name": "f", "input_schema": {"type": "object"}}], "tool_choice": {"type": "tool", "name": "web_search"}},
        "messages.2.content.0.content.0": {**base, "messages": [
            *base["messages"],
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [png]}]}]},
    }

    async def scenario():
        async with local_stack([chatml]) as stack:
            answer = await stack.http.post("/v1/messages", json={
                **base, "output_config": {"effort": "low", "format": {"type": "json_schema", "schema": schema}}})
            refused = {param: await stack.http.post("/v1/messages", json=body) for param, body in refusals.items()}
            return answer, refused

    answer, refused = asyncio.run(scenario())
    assert answer.status_code == 200, answer.text
    message = Message.model_validate(answer.json())
    assert message.stop_reason == "end_turn"
    assert json.loads(message.content[0].text) in ({"ok": True}, {"ok": False})
    for param, response in refused.items():
        assert response.status_code == 400, (param, response.text)
        error = response.json()
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
        assert param in error["error"]["message"], error
