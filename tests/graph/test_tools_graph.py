"""Tools, reasoning and the Anthropic Messages API end to end: serve_config's graph on Ray Serve with a
tiny model speaking SmolLM2's real tokenizer and a Qwen3 tool template, driven by the official
`openai` and `anthropic` clients, and the Responses API's Codex-style tool loop on the same graph (the session's
shared graph, tests/graph/shared_graph.py). Forced calls (tool_choice required / any) rely on the engine's
structured-output masks: a random model writes a valid call only through them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import anthropic
import httpx
import jsonschema
import openai
import pytest
from pydantic import TypeAdapter

from tests.graph.shared_graph import TOOLS as MODEL
from tests.graph.shared_graph import TOOLS_CONTEXT as CONTEXT
from tests.graph.shared_graph import SharedGraph

CLAUDE_CODE_REQUEST = Path(__file__).parents[1] / "serve" / "data" / "claude_code_request.json"
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Berlin", "Tokyo"]},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
OPENAI_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                                  "parameters": WEATHER_SCHEMA}}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER_SCHEMA}]
QUESTION = "What is the weather in Paris?"
MARKUP = ("<tool_call", "</tool_call", "<think>", "</think>")
# The Responses API's tools (Codex's default web_search beside a function) and the second turn's answer format.
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather in a city",
                    "parameters": WEATHER_SCHEMA, "strict": False}, {"type": "web_search", "external_web_access": False}]
ANSWER = {"type": "object", "properties": {"sky": {"type": "string", "enum": ["sunny", "rainy"]}},
          "required": ["sky"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tools_graph(shared_graph) -> SharedGraph:
    """The shared graph, whose tiny/tools model (context 1536) has the Qwen3 tool template and no parser names:
    qwen3's tool-call and <think> parsers are inferred from the template. Its ingress stores 10 Responses."""
    return shared_graph


def _no_markup(text: str | None) -> bool:
    return not any(marker in (text or "") for marker in MARKUP)


# ---- OpenAI ------------------------------------------------------------------------------------
@dataclass
class OpenAITurn:
    content: str | None
    reasoning: str | None
    tool_calls: list[dict]
    finish_reason: str
    prompt_tokens: int


def _openai_turn(client: openai.OpenAI, stream: bool, **request) -> OpenAITurn:
    request = {"model": MODEL, "temperature": 0, **request}
    if not stream:
        response = client.chat.completions.create(**request)
        message = response.choices[0].message
        calls = [c.model_dump() for c in message.tool_calls or []]
        reasoning = (message.model_extra or {}).get("reasoning_content")
        return OpenAITurn(message.content, reasoning, calls, response.choices[0].finish_reason,
                          response.usage.prompt_tokens)
    chunks = list(client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True}))
    content, reasoning, calls, reason = "", "", {}, None
    for chunk in chunks[:-1]:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        reason = chunk.choices[0].finish_reason or reason
        for part in delta.tool_calls or []:
            if part.index not in calls:  # OpenAI's first delta of a call: id, type, name, empty arguments
                assert part.id and part.type == "function" and part.function.name and part.function.arguments == ""
                calls[part.index] = {"id": part.id, "type": "function",
                                     "function": {"name": part.function.name, "arguments": ""}}
            else:  # later deltas: index and an argument fragment only
                assert part.id is None and part.function.name is None
                calls[part.index]["function"]["arguments"] += part.function.arguments
    return OpenAITurn(content or None, reasoning or None, [calls[i] for i in sorted(calls)], reason,
                      chunks[-1].usage.prompt_tokens)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_openai_two_round_tool_loop(tools_graph, stream):
    client = tools_graph.openai()
    messages = [{"role": "user", "content": QUESTION}]
    first = _openai_turn(client, stream, messages=messages, tools=OPENAI_TOOLS, tool_choice="required",
                         max_tokens=80)
    assert first.finish_reason == "tool_calls" and first.content is None, first
    (call,) = first.tool_calls
    assert call["function"]["name"] == "get_weather" and call["id"].startswith("call_")
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER_SCHEMA)

    messages += [{"role": "assistant", "content": None, "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": call["id"], "content": '{"temperature": 18, "sky": "sunny"}'}]
    final = _openai_turn(client, stream, messages=messages, tools=OPENAI_TOOLS, max_tokens=12)
    assert final.finish_reason == "length" and final.content and _no_markup(final.content)
    assert final.tool_calls == [] and final.prompt_tokens > first.prompt_tokens


def test_openai_streamed_tool_call_equals_the_whole_one(tools_graph):
    client = tools_graph.openai()
    request = {"messages": [{"role": "user", "content": QUESTION}], "tools": OPENAI_TOOLS, "max_tokens": 80,
               "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    whole, streamed = _openai_turn(client, False, **request), _openai_turn(client, True, **request)
    strip_ids = lambda calls: [{**c, "id": None} for c in calls]  # noqa: E731
    assert strip_ids(whole.tool_calls) == strip_ids(streamed.tool_calls) and len(whole.tool_calls) == 1
    assert whole.finish_reason == streamed.finish_reason == "tool_calls"


def test_openai_reasoning_is_separated(tools_graph):
    client = tools_graph.openai()
    messages = [{"role": "user", "content": QUESTION}]
    for stream in (False, True):
        thinking = _openai_turn(client, stream, messages=messages, max_tokens=16,
                                extra_body={"chat_template_kwargs": {"enable_thinking": True}})
        # The prompt opens <think> and the model never closes it: everything is reasoning.
        assert thinking.reasoning and _no_markup(thinking.reasoning) and not thinking.content
        plain = _openai_turn(client, stream, messages=messages, max_tokens=16,
                             extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert plain.content and plain.reasoning is None
    whole = _openai_turn(client, False, messages=messages, max_tokens=16,
                         extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert whole.reasoning == thinking.reasoning  # streamed == whole (greedy)


# ---- Anthropic ---------------------------------------------------------------------------------
GREEDY = {"temperature": 0}  # this anthropic SDK has no temperature argument: sent as an extra field


def _anthropic_turn(client: anthropic.Anthropic, stream: bool, **request) -> anthropic.types.Message:
    request = {"model": MODEL, "extra_body": GREEDY, **request}
    if not stream:
        return client.messages.create(**request)
    with client.messages.stream(**request) as events:
        kinds = [event.type for event in events]
        message = events.get_final_message()
    assert kinds[:1] == ["message_start"] and kinds[-2:] == ["message_delta", "message_stop"], kinds
    return message


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_anthropic_two_round_tool_loop(tools_graph, stream):
    client = tools_graph.anthropic()
    messages = [{"role": "user", "content": QUESTION}]
    first = _anthropic_turn(client, stream, messages=messages, tools=ANTHROPIC_TOOLS, max_tokens=80,
                            tool_choice={"type": "any"})
    assert first.stop_reason == "tool_use", first
    (use,) = [block for block in first.content if block.type == "tool_use"]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER_SCHEMA)

    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C, sunny"}]}]
    final = _anthropic_turn(client, stream, messages=messages, tools=ANTHROPIC_TOOLS, max_tokens=12)
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 12
    assert [b.type for b in final.content] == ["text"] and _no_markup(final.content[0].text)
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens > first.usage.input_tokens


def test_anthropic_thinking_blocks_match_openai_reasoning(tools_graph):
    messages = [{"role": "user", "content": QUESTION}]
    reasoning = _openai_turn(tools_graph.openai(), False, messages=messages, max_tokens=16,
                             extra_body={"chat_template_kwargs": {"enable_thinking": True}}).reasoning
    client = tools_graph.anthropic()
    for stream in (False, True):
        message = _anthropic_turn(client, stream, messages=messages, max_tokens=16,
                                  thinking={"type": "enabled", "budget_tokens": 1024})
        assert [b.type for b in message.content] == ["thinking"] and message.content[0].thinking == reasoning
        plain = _anthropic_turn(client, stream, messages=messages, max_tokens=16, thinking={"type": "disabled"})
        assert [b.type for b in plain.content] == ["text"] and plain.content[0].text


def test_count_tokens_equals_the_prompt_tokens_of_the_same_request(tools_graph):
    client = tools_graph.anthropic()
    request = {
        "model": MODEL,
        "system": [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": QUESTION},
                     {"role": "assistant", "content": "Let me think."},
                     {"role": "user", "content": [{"type": "text", "text": "Go on."}]}],
        "tools": ANTHROPIC_TOOLS,
    }
    counted = client.messages.count_tokens(**request).input_tokens
    for _ in range(2):  # the second request reads its prompt from the prefix cache
        usage = client.messages.create(**request, max_tokens=4, extra_body=GREEDY).usage
        assert usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens == counted
    assert usage.cache_read_input_tokens > 0
    assert client.messages.count_tokens(**{**request, "tools": None}).input_tokens < counted


def test_claude_code_request_is_accepted_and_answered(tools_graph):
    """A recorded Claude Code request body, as sent (model name aside): system blocks with cache_control,
    a thinking + tool_use turn and its tool_result, tools with input_schema, metadata, max_tokens 32000."""
    body = json.loads(CLAUDE_CODE_REQUEST.read_text())
    body["model"] = MODEL
    headers = {"anthropic-version": "2023-06-01", "x-api-key": "unused", "user-agent": "claude-cli/2.0.1 (external, cli)",
               "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,fine-grained-tool-streaming-2025-05-14"}
    with httpx.Client(base_url=tools_graph.url, timeout=60) as http:
        response = http.post("/v1/messages?beta=true", json=body, headers=headers)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    adapter = TypeAdapter(anthropic.types.RawMessageStreamEvent)
    payloads = _named_sse(response.text)
    assert payloads[1] == {"type": "ping"}
    events = [adapter.validate_python(e) for e in payloads if e["type"] != "ping"]
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    # thinking is enabled: the answer is one thinking block; max_tokens 32000 is lowered to the room left.
    assert events[1].content_block.type == "thinking" and kinds.count("content_block_start") == 1
    assert {e.delta.type for e in events if e.type == "content_block_delta"} == {"thinking_delta"}
    prompt_tokens = events[0].message.usage.input_tokens
    final = events[-2]
    assert final.delta.stop_reason == "max_tokens" and final.usage.output_tokens == CONTEXT - prompt_tokens


def test_anthropic_errors_have_anthropic_bodies(tools_graph):
    client = tools_graph.anthropic()
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="no-such-model", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert missing.value.body == {"type": "error", "error": {
        "type": "not_found_error", "message": "The model 'no-such-model' does not exist"}}
    with pytest.raises(anthropic.BadRequestError) as bad_choice:
        client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}],
                               tools=ANTHROPIC_TOOLS, tool_choice={"type": "tool", "name": "nope"})
    assert bad_choice.value.body["error"]["type"] == "invalid_request_error"
    assert "nope" in bad_choice.value.body["error"]["message"]


def _named_sse(text: str) -> list[dict]:
    """Anthropic's SSE: each event is `event: NAME` + `data: JSON`, names matching the payload types."""
    events = []
    for block in text.strip().split("\n\n"):
        name_line, data_line = block.split("\n")
        payload = json.loads(data_line.removeprefix("data: "))
        assert name_line == f"event: {payload['type']}"
        events.append(payload)
    return events


# ---- the Responses API ----------------------------------------------------------------------------
def _streamed_response_turn(client: openai.OpenAI, **request):
    """One streamed turn: the event types in order, with contiguous sequence numbers, and the final Response."""
    with client.responses.stream(model=MODEL, temperature=0, tools=RESPONSES_TOOLS, **request) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert all(getattr(e, "response", final).id == final.id for e in events)
    return [e.type for e in events], final


def test_responses_streamed_two_turn_tool_loop_with_previous_response_id(tools_graph):
    """A Codex-style loop on the Responses API: both turns streamed, the second continuing the first through
    previous_response_id, so the stored response lives in the ingress replica while the model runs in its own."""
    client = tools_graph.openai()
    kinds, first = _streamed_response_turn(client, input="What is the weather in Paris?", tool_choice="required",
                                  max_output_tokens=80)
    deltas = kinds.count("response.function_call_arguments.delta")
    assert deltas >= 1 and kinds == [
        "response.created", "response.in_progress", "response.output_item.added",
        *["response.function_call_arguments.delta"] * deltas, "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    assert first.status == "completed" and [t.name for t in first.tools] == ["get_weather"]
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)

    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 18, "sky": "sunny"}'}
    kinds, second = _streamed_response_turn(client, previous_response_id=first.id, input=[result], reasoning={"effort": "none"},
                                   text={"format": {"type": "json_schema", "name": "answer", "schema": ANSWER,
                                                    "strict": True}}, max_output_tokens=40)
    texts = kinds.count("response.output_text.delta")
    assert texts >= 1 and kinds == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * texts, "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    assert second.status == "completed" and second.previous_response_id == first.id
    jsonschema.validate(json.loads(second.output_text), ANSWER)
    # The first turn's prompt and call came from the ingress's store, and their prefix from the model's cache.
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0

    stored = client.responses.retrieve(second.id)
    assert stored.output_text == second.output_text and stored.previous_response_id == first.id
    client.responses.delete(first.id)
    with pytest.raises(openai.BadRequestError) as gone:  # the chain of `second` lost its first turn
        client.responses.create(model=MODEL, previous_response_id=second.id, input="And tomorrow?")
    assert gone.value.body["code"] == "previous_response_not_found"
