"""Anthropic and OpenAI conversions and renderers for tools and reasoning (no model).

Streamed renderings are accumulated with each SDK's own stream accumulator and compared with the
whole responses, so streamed == whole holds as the clients see it."""

from __future__ import annotations

import json

import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message
from openai.lib.streaming.chat._completions import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import ValidationError

from deployments.api.anthropic_convert import chat_prompt, messages_job
from deployments.api.anthropic_render import MessageMeta, MessageStreamRenderer, message_response
from deployments.api.anthropic_schemas import MessagesRequest
from deployments.api.openai_convert import chat_job
from deployments.api.errors import as_anthropic, wire_error
from deployments.api.openai_render import ChatRenderer, ResponseMeta
from deployments.api.openai_schemas import ChatCompletionRequest
from deployments.model_calls import StreamChunk
from engine.errors import InvalidRequestError, ModelNotFoundError, QueueFullError, QueueTimeoutError
from engine.output.request_output import Finish, Usage
from deployments.output_deltas import ContentDelta, ReasoningDelta, ToolCallDelta
from engine.request import FinishReason

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"name": "get_weather", "description": "Weather", "input_schema": SCHEMA, "cache_control": {"type": "ephemeral"}}
STOP = Finish(FinishReason.STOP, Usage(100, 9, cached_tokens=64))
# One generation as the model side streams it: reasoning, text, then two calls (arguments whole).
CHUNKS = [
    StreamChunk(reasoning="Need the", num_tokens=2, prompt_tokens=100),
    StreamChunk(reasoning=" weather.", text="Checking", num_tokens=3),
    StreamChunk(text=" both.", tool_calls=[ToolCallDelta(0, '{"city": "Paris"}', "call_a1", "get_weather")]),
    StreamChunk(tool_calls=[ToolCallDelta(1, '{"city": "Oslo"}', "call_b2", "get_weather")], num_tokens=4, finish=STOP),
]


def _whole() -> StreamChunk:
    total = StreamChunk()
    for chunk in CHUNKS:
        total.merge(StreamChunk(chunk.text, chunk.num_tokens, None, chunk.finish, None, chunk.reasoning,
                                list(chunk.tool_calls), chunk.prompt_tokens))
    return total


# ---- Anthropic requests --------------------------------------------------------------------------
def test_anthropic_messages_become_template_messages():
    body = MessagesRequest.model_validate({
        "model": "m", "max_tokens": 50, "stop_sequences": ["END"], "temperature": 0.2, "top_p": 0.9, "top_k": 5,
        "metadata": {"user_id": "u1"}, "service_tier": "auto", "thinking": {"type": "enabled", "budget_tokens": 2000},
        "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        "tools": [TOOL], "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        "messages": [
            {"role": "system", "content": "Also be kind."},
            {"role": "user", "content": [{"type": "text", "text": "Weather?", "cache_control": {"type": "ephemeral"}}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Use the tool.", "signature": "sig"},
                {"type": "redacted_thinking", "data": "xyz"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18 C"}],
                 "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "And tomorrow?"}]},
            {"role": "system", "content": [{"type": "text", "text": "Answer in French."}]},
        ],
    })
    job = messages_job(body, "msg_1", "log")
    s = job.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.stop) == (50, 0.2, 0.9, 5, ("END",))
    assert job.clamp_max_tokens and not job.stream
    prompt = job.prompt
    assert prompt.messages == [
        {"role": "system", "content": "Be brief.\n\nAlso be kind."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Use the tool.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C"},
        {"role": "user", "content": "And tomorrow?"},
        {"role": "system", "content": "Answer in French."},
    ]
    assert prompt.tools == [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA,
                                                              "description": "Weather"}}]
    assert (prompt.tool_choice, prompt.tool_name, prompt.parallel_tool_calls) == ("function", "get_weather", False)
    assert prompt.template_kwargs == {"enable_thinking": True}


@pytest.mark.parametrize("choice, mode", [({"type": "auto"}, "auto"), ({"type": "any"}, "required"),
                                          ({"type": "none"}, "none")])
def test_anthropic_tool_choice_modes(choice, mode):
    body = MessagesRequest(model="m", max_tokens=5, messages=[{"role": "user", "content": "hi"}], tools=[TOOL],
                           tool_choice=choice)
    assert chat_prompt(body).tool_choice == mode


@pytest.mark.parametrize("fields, param", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "x"}}]}]},
     "messages.0.content.0"),
    ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": [TOOL]}, "tool_choice.name"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
])
def test_anthropic_requests_refused_with_the_field_named(fields, param):
    body = MessagesRequest.model_validate({"model": "m", "max_tokens": 5,
                                           "messages": [{"role": "user", "content": "hi"}], **fields})
    with pytest.raises(InvalidRequestError) as refused:
        messages_job(body, "r", "l")
    assert refused.value.param == param


def test_anthropic_unknown_fields_are_ignored_known_ones_read():
    base = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}
    # Claude Code 2.1's and other clients' newer fields: accepted, they do not change the answer (issue 26).
    accepted = MessagesRequest.model_validate({**base, "warp": 1, "speed": "fast", "betas": ["x"],
                                               "output_config": {"effort": "high"}, "inference_geo": "eu"})
    assert accepted.output_config.effort == "high" and accepted.model_extra["speed"] == "fast"
    # An output format is structured output, and Anthropic's own tools are accepted and not offered
    # (tests/serve/test_claude_code_shapes.py); a format we cannot honour stays refused.
    with pytest.raises(ValidationError, match="output_config.format.type"):
        MessagesRequest.model_validate({**base, "output_config": {"format": {"type": "json_object"}}})
    search = {"type": "web_search_20250305", "name": "web_search"}
    with_search = MessagesRequest.model_validate({**base, "tools": [search]})
    assert chat_prompt(with_search).tools is None


# ---- Anthropic responses -------------------------------------------------------------------------
def test_anthropic_whole_response_blocks_and_usage():
    body = message_response(MessageMeta("msg_1", "m"), [_whole()])
    message = Message.model_validate(body)
    assert [b.type for b in message.content] == ["thinking", "text", "tool_use", "tool_use"]
    assert message.content[0].thinking == "Need the weather." and message.content[1].text == "Checking both."
    assert message.content[2].id == "toolu_a1" and message.content[3].input == {"city": "Oslo"}
    assert message.stop_reason == "tool_use" and message.stop_sequence is None
    assert body["usage"] == {"input_tokens": 36, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 64,
                             "output_tokens": 9}


def test_anthropic_stream_accumulates_to_the_whole_response():
    renderer = MessageStreamRenderer(MessageMeta("msg_1", "m"))
    events = [e for chunk in CHUNKS for e in renderer.events(chunk)]
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-2:] == ["message_delta", "message_stop"]
    assert events[0][1]["message"]["usage"]["input_tokens"] == 100
    starts = [payload["content_block"] for name, payload in events if name == "content_block_start"]
    assert starts[2] == {"type": "tool_use", "id": "toolu_a1", "name": "get_weather", "input": {}}
    tool_deltas = [p["delta"] for n, p in events if n == "content_block_delta" and p["index"] == 2]
    assert tool_deltas == [{"type": "input_json_delta", "partial_json": ""},
                           {"type": "input_json_delta", "partial_json": '{"city": "Paris"}'}]
    snapshot, json_bufs = None, {}
    for name, payload in events:
        assert payload["type"] == name
        if name != "ping":
            snapshot = accumulate_event(event=payload, current_snapshot=snapshot, json_bufs=json_bufs)
    whole = Message.model_validate(message_response(MessageMeta("msg_1", "m"), [_whole()]))
    assert snapshot.model_dump(exclude={"content": {"__all__": {"parsed_output"}}}) == whole.model_dump()


@pytest.mark.parametrize("finish, calls, expected", [
    (Finish(FinishReason.LENGTH, Usage(1, 1)), [], ("max_tokens", None)),
    (Finish(FinishReason.STOP, Usage(1, 1), stop_reason="END"), [], ("stop_sequence", "END")),
    (Finish(FinishReason.STOP, Usage(1, 1), stop_reason=2), [], ("end_turn", None)),
    (Finish(FinishReason.STOP, Usage(1, 1), stop_reason=2), [ToolCallDelta(0, "oops", "call_x", "f")], ("tool_use", None)),
])
def test_anthropic_stop_reasons(finish, calls, expected):
    body = message_response(MessageMeta("msg_1", "m"), [StreamChunk(text="hi", tool_calls=calls, finish=finish)])
    assert (body["stop_reason"], body["stop_sequence"]) == expected
    if calls:  # arguments that are not a JSON object are kept under one key
        assert body["content"][1]["input"] == {"_raw_arguments": "oops"}


@pytest.mark.parametrize("error, status, type_", [
    (InvalidRequestError("bad", param="max_tokens"), 400, "invalid_request_error"),
    (ModelNotFoundError("who"), 404, "not_found_error"),
    (QueueFullError("full"), 429, "rate_limit_error"),
    (QueueTimeoutError("slow"), 503, "overloaded_error"),
    (KeyError("secret"), 500, "api_error"),
])
def test_anthropic_error_bodies(error, status, type_):
    wire = as_anthropic(wire_error(error))
    assert wire.status == status and wire.body["type"] == "error" and wire.body["error"]["type"] == type_
    assert set(wire.body["error"]) == {"type", "message"} and "secret" not in wire.body["error"]["message"]
    if status == 400:
        assert wire.body["error"]["message"] == "max_tokens: bad"


# ---- OpenAI ----------------------------------------------------------------------------------------
def test_openai_whole_response_with_reasoning_and_tool_calls():
    body = ChatRenderer(ResponseMeta("chatcmpl-1", 1, "m")).completion([_whole()])
    parsed = ChatCompletion.model_validate(body)
    choice = parsed.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking both."
    assert body["choices"][0]["message"]["reasoning_content"] == "Need the weather."
    assert [(c.id, c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("call_a1", "get_weather", {"city": "Paris"}), ("call_b2", "get_weather", {"city": "Oslo"})]


def test_openai_stream_tool_call_deltas_are_openai_shaped():
    renderer = ChatRenderer(ResponseMeta("chatcmpl-1", 1, "m"))
    payloads = [p for chunk in CHUNKS for p in renderer.stream_payloads(chunk)]
    deltas = [p["choices"][0]["delta"] for p in payloads]
    tool_deltas = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert tool_deltas[:2] == [
        [{"index": 0, "id": "call_a1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}],
        [{"index": 0, "function": {"arguments": '{"city": "Paris"}'}}],
    ]
    assert {"reasoning_content": "Need the"} in deltas and payloads[-1]["choices"][0]["finish_reason"] == "tool_calls"
    state = ChatCompletionStreamState()
    for payload in payloads:
        state.handle_chunk(ChatCompletionChunk.model_validate(payload))
    streamed = state.get_final_completion().choices[0].message
    whole = ChatCompletion.model_validate(ChatRenderer(ResponseMeta("chatcmpl-1", 1, "m")).completion([_whole()]))
    assert streamed.content == whole.choices[0].message.content
    assert [c.function.model_dump(exclude={"parsed_arguments"}) for c in streamed.tool_calls] == [
        c.function.model_dump() for c in whole.choices[0].message.tool_calls]


def test_openai_tool_choice_checks_and_modes():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    for fields, param in [({"tool_choice": "required"}, "tool_choice"),
                          ({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "x"}}},
                           "tool_choice")]:
        with pytest.raises(InvalidRequestError) as refused:
            chat_job(ChatCompletionRequest.model_validate({**base, **fields}), "r", "l")
        assert refused.value.param == param
    job = chat_job(ChatCompletionRequest.model_validate(
        {**base, "tools": tools, "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
         "parallel_tool_calls": False}), "r", "l")
    assert (job.prompt.tool_choice, job.prompt.tool_name, job.prompt.parallel_tool_calls) == (
        "function", "get_weather", False)
    assert chat_job(ChatCompletionRequest.model_validate({**base, "tools": tools}), "r", "l").prompt.tool_choice == "auto"


# ---- the model side's plan -------------------------------------------------------------------------
def test_output_plan_per_request():
    from deployments.chat.output_plan import plan_output
    from deployments.model_calls import ChatPrompt, GenerateJob, TextPrompt
    from deployments.chat.parsers.selection import ParserNames
    from engine.sampling.params import SamplingParams

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]
    qwen3, harmony = ParserNames("qwen3", "qwen3"), ParserNames("harmony", "harmony")
    opened = "<|im_start|>assistant\n<think>\n"

    def plan(names, prompt, text=opened):
        return plan_output(names, GenerateJob("r", prompt, SamplingParams(), stream=False), text)

    forced = plan(qwen3, ChatPrompt([], tools, tool_choice="required"))
    assert forced.sampling.guided.kind == "regex" and forced.sampling.guided.spec.startswith("<tool_call>")
    assert not forced.sampling.skip_special_tokens  # tool markers may be special tokens
    # A forced call starts at the first token: not read as reasoning though the prompt opened <think>.
    assert [type(e).__name__ for e in forced.parser.feed('<tool_call>\n{"name": "get_weather", "arguments": '
                                                         '{"city": "x"}}\n</tool_call>')] == ["ToolCallDelta"]
    auto = plan(qwen3, ChatPrompt([], tools))
    assert auto.sampling.guided is None and auto.parser.feed("why</think>ok") == [
        ReasoningDelta("why"), ContentDelta("ok")]
    none = plan(qwen3, ChatPrompt([], tools, tool_choice="none"))
    assert none.sampling.skip_special_tokens and none.sampling.guided is None
    assert plan(harmony, ChatPrompt([], None)).sampling.skip_special_tokens is False  # channel markers
    assert plan(qwen3, TextPrompt(text="x")).parser is None  # /v1/completions: raw text

