"""OpenAI's Responses API (POST /v1/responses, GET / DELETE /v1/responses/{id}) in process, with the official `openai`
client and raw HTTP: shapes checked against the SDK's own types (strict pydantic validation), event order, stored
responses and previous_response_id, tools, structured output, reasoning items, refusals.

One tiny random model speaks SmolLM2's real tokenizer with a Qwen3 tool template (tool-call and <think> parsers
inferred from it). A random model writes a valid call only when forced (tool_choice required: constrained decoding),
and ends on its own only under a JSON schema: the tests that need `completed` ask for one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, Field, TypeAdapter

from deployments.config import ModelConfig
from tests.serve.local_stack import LocalStack, local_stack
from tests.support.json_schemas import SCHEMAS, parse_and_validate
from tests.support.tiny_models import write_smollm2_tokenizer_model

TEMPLATE = Path(__file__).resolve().parents[1] / "support" / "qwen3_tools.jinja"
MODEL = "tiny/responses"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Berlin", "Tokyo"]},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER,
          "strict": True}]
QUESTION = "What is the weather in Paris?"
SKY = {"type": "json_schema", "name": "sky", "strict": True, "schema": {
    "type": "object", "properties": {"sky": {"type": "string", "enum": ["sunny", "rainy", "cloudy"]}},
    "required": ["sky"], "additionalProperties": False}}
NO_THINKING = {"effort": "none"}  # the template opens <think> unless enable_thinking is false
GREEDY = {"model": MODEL, "temperature": 0}
INSTRUCTIONS = "Answer briefly and plainly. " * 12  # long enough for whole prefix-cache blocks
EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
MARKUP = ("<tool_call", "</tool_call", "<think>", "</think>")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> ModelConfig:
    folder = write_smollm2_tokenizer_model(tmp_path_factory.mktemp("responses") / "model",
                                           {"max_position_embeddings": 4096}, seed=1, scale=3.0)
    return ModelConfig(model_id=MODEL, model_path=str(folder), context_length=1536, chat_template_file=str(TEMPLATE),
                       default_max_tokens=24)


@contextlib.asynccontextmanager
async def client_and_stack(config: ModelConfig):
    async with local_stack([config]) as stack:
        yield openai.AsyncOpenAI(base_url="http://orchard/v1", api_key="unused", http_client=stack.http,
                                 max_retries=0), stack


def named_events(text: str) -> list[dict[str, Any]]:
    """The events of a Responses SSE body: `event: TYPE` + `data: JSON`, the name equal to the payload's type, each
    event valid for the SDK's types; sequence numbers run 0, 1, 2, ... SSE comments (the ingress's keep-alives while
    a request waits in the queue) are skipped, as clients do."""
    events = []
    for block in text.strip().split("\n\n"):
        if block.startswith(":"):
            continue
        name_line, data_line = block.split("\n")
        payload = json.loads(data_line.removeprefix("data: "))
        assert name_line == f"event: {payload['type']}"
        EVENTS.validate_python(payload)
        events.append(payload)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def comparable(response: dict[str, Any]) -> dict[str, Any]:
    """A Response without what differs between two requests for the same answer: ids, times, cache hits."""
    response = json.loads(json.dumps(response))
    for key in ("id", "created_at", "completed_at"):
        response.pop(key)
    for item in response["output"]:
        item.pop("id")
        item.pop("call_id", None)
        item.pop("parsed_arguments", None)  # the SDK's parse (responses.stream)
        for part in item.get("content") or []:
            part.pop("parsed", None)  # the SDK's parse of the text (responses.stream)
    response["usage"]["input_tokens_details"].pop("cached_tokens")
    return response


# One letter per event type: a stream is created, in_progress, then items, each added ... done, then its end.
_LETTERS = {"response.created": "C", "response.in_progress": "I", "response.output_item.added": "A",
            "response.content_part.added": "P", "response.output_text.delta": "t", "response.output_text.done": "T",
            "response.reasoning_text.delta": "r", "response.reasoning_text.done": "R",
            "response.content_part.done": "Q",
            "response.function_call_arguments.delta": "f", "response.function_call_arguments.done": "F",
            "response.output_item.done": "D", "response.completed": "Z", "response.incomplete": "Z"}
STREAM_GRAMMAR = re.compile(r"CI(A(Pt+TQ|Pr+RQ|f*F)D)*Z")


def follows_the_grammar(kinds: list[str]) -> bool:
    """The grammar, after the opening, without keep-alives (response.in_progress after 10 s without an event: a
    long prefill on a busy CPU)."""
    kinds = kinds[:2] + [kind for kind in kinds[2:] if kind != "response.in_progress"]
    return STREAM_GRAMMAR.fullmatch("".join(_LETTERS.get(kind, "?") for kind in kinds)) is not None


def expected_kinds(kinds: list[str], item: str, end: str) -> list[str]:
    """OpenAI's order for one text or reasoning item, with as many deltas as were sent."""
    delta = {"message": "response.output_text.delta", "reasoning": "response.reasoning_text.delta"}[item]
    done = {"message": "response.output_text.done", "reasoning": "response.reasoning_text.done"}[item]
    deltas = kinds.count(delta)
    assert deltas >= 1, kinds
    return ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
            *[delta] * deltas, done, "response.content_part.done", "response.output_item.done", end]


# ---- text ----------------------------------------------------------------------------------------
def test_create_answers_a_response_object_with_echoes_and_cached_usage(model):
    body = {**GREEDY, "input": "t1 t2 t3", "max_output_tokens": 6, "instructions": INSTRUCTIONS,
            "reasoning": NO_THINKING, "metadata": {"k": "v"}, "user": "u1", "truncation": "auto"}

    async def scenario():
        async with client_and_stack(model) as (client, stack):
            first = await stack.http.post("/v1/responses", json=body)
            second = await stack.http.post("/v1/responses", json=body)  # its prompt comes from the prefix cache
            sdk = await client.responses.create(**body)
            with_logprobs = await stack.http.post("/v1/responses", json={
                **body, "include": ["message.output_text.logprobs"], "top_logprobs": 2})
            return first, second, sdk, with_logprobs

    first, second, sdk, with_logprobs = asyncio.run(scenario())
    assert first.status_code == 200, first.text
    raw = first.json()
    parsed = Response.model_validate(raw)  # strict: every required field present with its type
    assert parsed.id.startswith("resp_") and parsed.object == "response" and parsed.model == MODEL
    assert parsed.status == "incomplete" and parsed.incomplete_details.reason == "max_output_tokens"
    assert raw["completed_at"] is None and raw["error"] is None
    (message,) = parsed.output
    assert message.type == "message" and message.role == "assistant" and message.status == "incomplete"
    assert message.id.startswith("msg_") and len(message.content) == 1
    text = message.content[0]
    assert text.type == "output_text" and text.annotations == [] and text.text and parsed.output_text == text.text
    assert not any(marker in text.text for marker in MARKUP)
    usage = raw["usage"]
    assert usage["output_tokens"] == 6 and usage["total_tokens"] == usage["input_tokens"] + 6
    assert usage["input_tokens_details"] == {"cached_tokens": 0, "cache_write_tokens": 0}
    assert usage["output_tokens_details"] == {"reasoning_tokens": 0}
    assert second.json()["usage"]["input_tokens_details"]["cached_tokens"] > 0
    assert {k: raw[k] for k in ("instructions", "max_output_tokens", "temperature", "top_p", "store", "metadata",
                                "user", "truncation", "tools", "tool_choice", "parallel_tool_calls",
                                "previous_response_id", "text", "reasoning")} == {
        "instructions": INSTRUCTIONS, "max_output_tokens": 6, "temperature": 0.0, "top_p": 1.0, "store": True,
        "metadata": {"k": "v"}, "user": "u1", "truncation": "auto", "tools": [], "tool_choice": "auto",
        "parallel_tool_calls": True, "previous_response_id": None, "text": {"format": {"type": "text"},
                                                                            "verbosity": "medium"},
        "reasoning": {"effort": "none", "summary": None}}
    assert sdk.output_text == text.text  # greedy: the same answer through the SDK
    logprobs = Response.model_validate(with_logprobs.json()).output[0].content[0].logprobs
    # The parser drops whitespace before the content (after the closed <think> block); the tokens keep it.
    assert len(logprobs) == 6 and "".join(p.token for p in logprobs).lstrip() == text.text
    assert all(len(p.top_logprobs) == 2 and p.logprob <= 0 for p in logprobs)


def test_input_items_become_the_same_prompt_as_their_chat_equivalent(model):
    """Token counts show how items are rendered: instructions + developer messages are one system message, a
    reasoning item is given back to the template, unknown item and part types are ignored."""
    def tokens_of(stack: LocalStack, **fields):
        return stack.http.post("/v1/responses", json={**GREEDY, "max_output_tokens": 1, "reasoning": NO_THINKING,
                                                      **fields})

    user = {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather",
            "arguments": '{"city": "Paris", "unit": "celsius"}'}
    result = {"type": "function_call_output", "call_id": "call_1", "output": "18 C, sunny"}
    thought = {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": None,
               "content": [{"type": "reasoning_text", "text": "I should look it up."}]}

    async def scenario():
        async with client_and_stack(model) as (_, stack):
            split = await tokens_of(stack, instructions="Be brief.",
                                    input=[{"role": "developer", "content": "Use tools."}, user])
            joined = await tokens_of(stack, input=[{"role": "system", "content": "Be brief.\n\nUse tools."}, user])
            plain = await tokens_of(stack, input=[user, call, result], tools=TOOLS)
            with_unknown = await tokens_of(stack, tools=TOOLS, input=[
                {**user, "content": [*user["content"], {"type": "input_sparkle", "x": 1}]},
                {"type": "future_item", "data": 1}, call, result])
            with_reasoning = await tokens_of(stack, input=[user, thought, call, result], tools=TOOLS)
            stats = (await stack.http.get("/v1/queue/stats")).json()
            return split, joined, plain, with_unknown, with_reasoning, stats

    split, joined, plain, with_unknown, with_reasoning, stats = asyncio.run(scenario())
    count = lambda r: r.json()["usage"]["input_tokens"]  # noqa: E731
    assert all(r.status_code == 200 for r in (split, joined, plain, with_unknown, with_reasoning))
    assert count(split) == count(joined)
    assert count(with_unknown) == count(plain)
    assert count(with_reasoning) > count(plain)
    ignored = stats["ignored_fields"]
    assert ignored["responses.input item:future_item"] >= 1 and ignored["responses.content part:input_sparkle"] >= 1


# ---- streams ---------------------------------------------------------------------------------------
def test_stream_event_order_and_the_sdk_accumulates_the_non_streamed_response(model):
    request = {**GREEDY, "input": "Is it sunny?", "text": {"format": SKY}, "reasoning": NO_THINKING,
               "max_output_tokens": 40}

    async def scenario():
        async with client_and_stack(model) as (client, stack):
            whole = await stack.http.post("/v1/responses", json=request)
            raw = await stack.http.post("/v1/responses", json={**request, "stream": True})
            async with client.responses.stream(**request) as stream:
                kinds = [event.type async for event in stream]
                final = await stream.get_final_response()
            return whole.json(), raw, kinds, final

    whole, raw, kinds, final = asyncio.run(scenario())
    assert raw.headers["content-type"].startswith("text/event-stream")
    events = named_events(raw.text)
    raw_kinds = [e["type"] for e in events]
    assert raw_kinds == expected_kinds(raw_kinds, "message", "response.completed")
    assert kinds == expected_kinds(kinds, "message", "response.completed")
    created, completed = events[0]["response"], events[-1]["response"]
    assert created["status"] == "in_progress" and created["output"] == [] and created["usage"] is None
    assert created["id"] == completed["id"] and completed["status"] == "completed" and completed["completed_at"]
    assert events[2]["item"] == {"id": events[2]["item"]["id"], "type": "message", "status": "in_progress",
                                 "role": "assistant", "content": []}
    streamed_text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert events[-4]["text"] == streamed_text == completed["output"][0]["content"][0]["text"]
    assert events[-2]["item"] == completed["output"][0]
    parse_and_validate(streamed_text, SKY["schema"])
    assert comparable(completed) == comparable(whole)
    assert comparable(final.model_dump(mode="json", exclude_unset=True, by_alias=True)) == comparable(whole)


def test_reasoning_streams_as_a_reasoning_item_and_a_cut_answer_is_incomplete(model):
    request = {**GREEDY, "input": QUESTION, "reasoning": {"effort": "high", "summary": "auto"},
               "max_output_tokens": 8}

    async def scenario():
        async with client_and_stack(model) as (_, stack):
            whole = await stack.http.post("/v1/responses", json=request)
            streamed = await stack.http.post("/v1/responses", json={**request, "stream": True})
            return whole.json(), streamed

    whole, streamed = asyncio.run(scenario())
    events = named_events(streamed.text)
    kinds = [e["type"] for e in events]
    assert kinds == expected_kinds(kinds, "reasoning", "response.incomplete")
    final = events[-1]["response"]
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    (item,) = final["output"]
    thought = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert item["type"] == "reasoning" and item["id"].startswith("rs_") and item["status"] == "incomplete"
    assert item["summary"] == [] and item["content"] == [{"type": "reasoning_text", "text": thought}]
    assert thought and not any(marker in thought for marker in MARKUP)
    assert comparable(final) == comparable(whole)


# ---- tools, chaining, the store ------------------------------------------------------------------------
def test_two_round_tool_loop_through_previous_response_id(model):
    forced = {**GREEDY, "input": QUESTION, "tools": TOOLS, "tool_choice": "required", "max_output_tokens": 80}

    async def scenario():
        async with client_and_stack(model) as (client, stack):
            first = await client.responses.create(**forced)
            streamed = await stack.http.post("/v1/responses", json={**forced, "stream": True})
            call = first.output[0]
            result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "sunny"}'}
            second = await client.responses.create(**GREEDY, previous_response_id=first.id, input=[result],
                                                   tools=TOOLS, text={"format": SKY}, reasoning=NO_THINKING)
            resent = await client.responses.create(**GREEDY, input=[
                {"role": "user", "content": QUESTION}, call.model_dump(exclude_none=True), result],
                tools=TOOLS, text={"format": SKY}, reasoning=NO_THINKING, store=False)
            return first, streamed, second, resent

    first, streamed, second, resent = asyncio.run(scenario())
    assert first.status == "completed" and len(first.output) == 1, first.output
    events = named_events(streamed.text)
    kinds = [e["type"] for e in events]
    deltas = kinds.count("response.function_call_arguments.delta")
    assert deltas >= 1 and kinds == [
        "response.created", "response.in_progress", "response.output_item.added",
        *["response.function_call_arguments.delta"] * deltas, "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    added, done = events[2]["item"], events[-2]["item"]
    assert added["type"] == "function_call" and added["arguments"] == "" and added["status"] == "in_progress"
    assert done["arguments"] == events[-3]["arguments"] == "".join(
        e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert comparable(events[-1]["response"]) == comparable(first.model_dump(mode="json", exclude_unset=True))
    call = first.output[0]
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    assert first.tools[0].name == "get_weather" and first.tool_choice == "required"
    assert second.status == "completed" and second.previous_response_id == first.id
    parse_and_validate(second.output_text, SKY["schema"])
    # The stored turn is the same prompt as the whole history sent again, and its start is read from the cache.
    assert second.usage.input_tokens == resent.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0
    assert second.output_text == resent.output_text


def test_functions_in_a_namespace_are_offered_and_their_calls_name_it(model):
    """Codex groups tools in namespace tools on every request (its multi-agent tools, each MCP server's): their
    functions are offered, a call to one tells its namespace (streamed and whole), and two functions of one name
    are refused."""
    grouped = [{"type": "namespace", "name": "weather_v1", "description": "Weather tools", "tools": TOOLS}]
    forced = {**GREEDY, "input": QUESTION, "tools": grouped, "tool_choice": "required", "max_output_tokens": 80}

    async def scenario():
        async with client_and_stack(model) as (client, stack):
            whole = await client.responses.create(**forced)
            streamed = await stack.http.post("/v1/responses", json={**forced, "stream": True})
            twice = await stack.http.post("/v1/responses", json={**forced, "tools": [*TOOLS, *grouped]})
            return whole, streamed, twice

    whole, streamed, twice = asyncio.run(scenario())
    call = whole.output[0]
    assert (call.type, call.name, call.namespace) == ("function_call", "get_weather", "weather_v1")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    assert whole.tools[0].type == "namespace" and [t.name for t in whole.tools[0].tools] == ["get_weather"]
    events = named_events(streamed.text)
    added = next(e["item"] for e in events if e["type"] == "response.output_item.added")
    assert (added["name"], added["namespace"]) == ("get_weather", "weather_v1")
    assert twice.status_code == 400 and twice.json()["error"]["param"] == "tools"
    assert "two functions named 'get_weather'" in twice.json()["error"]["message"]


def test_tools_on_a_model_whose_template_has_none(model):
    """SmolLM2's own ChatML template has no tool format: the generic one (deployments/chat) carries the loop."""
    plain = model.model_copy(update={"model_id": "tiny/plain", "chat_template_file": None})

    async def scenario():
        async with client_and_stack(plain) as (client, _):
            first = await client.responses.create(model="tiny/plain", temperature=0, input=QUESTION, tools=TOOLS,
                                                  tool_choice="required", max_output_tokens=80)
            result = {"type": "function_call_output", "call_id": first.output[0].call_id, "output": "18 C"}
            second = await client.responses.create(model="tiny/plain", temperature=0, input=[result], tools=TOOLS,
                                                   previous_response_id=first.id, max_output_tokens=8)
            return first, second

    first, second = asyncio.run(scenario())
    assert first.status == "completed" and [item.type for item in first.output] == ["function_call"]
    jsonschema.validate(json.loads(first.output[0].arguments), WEATHER)
    assert second.status == "incomplete" and [item.type for item in second.output] == ["message"]
    assert second.usage.input_tokens > first.usage.input_tokens


def test_stored_responses_get_delete_and_unknown_ids(model):
    async def scenario():
        async with client_and_stack(model) as (client, stack):
            http = stack.http
            created = (await http.post("/v1/responses", json={**GREEDY, "input": "t1", "max_output_tokens": 3,
                                                               "reasoning": NO_THINKING})).json()
            fetched = await http.get(f"/v1/responses/{created['id']}")
            sdk = await client.responses.retrieve(created["id"])
            unstored = (await http.post("/v1/responses", json={**GREEDY, "input": "t1", "max_output_tokens": 3,
                                                                "store": False})).json()
            unstored_get = await http.get(f"/v1/responses/{unstored['id']}")
            deleted = await http.delete(f"/v1/responses/{created['id']}")
            after = await http.get(f"/v1/responses/{created['id']}")
            again = await http.delete(f"/v1/responses/{created['id']}")
            chained = await http.post("/v1/responses", json={**GREEDY, "input": "t2",
                                                              "previous_response_id": created["id"]})
            with pytest.raises(openai.NotFoundError):
                await client.responses.retrieve("resp_nope")
            return created, fetched, sdk, unstored, unstored_get, deleted, after, again, chained

    created, fetched, sdk, unstored, unstored_get, deleted, after, again, chained = asyncio.run(scenario())
    assert fetched.status_code == 200 and fetched.json() == created
    assert sdk.id == created["id"] and sdk.output_text == created["output"][0]["content"][0]["text"]
    assert unstored["store"] is False and unstored_get.status_code == 404
    assert deleted.status_code == 200 and deleted.json() == {"id": created["id"], "object": "response", "deleted": True}
    missing = {"error": {"message": f"Response with id '{created['id']}' not found.",
                         "type": "invalid_request_error", "param": None, "code": None}}
    assert after.status_code == again.status_code == 404 and after.json() == again.json() == missing
    assert chained.status_code == 400 and chained.json() == {"error": {
        "message": f"Previous response with id '{created['id']}' not found.", "type": "invalid_request_error",
        "param": "previous_response_id", "code": "previous_response_not_found"}}


# ---- structured output -----------------------------------------------------------------------------------
class Person(BaseModel):
    name: str = Field(max_length=12)  # bounded, so that a random model's answer ends
    age: int = Field(ge=0, le=120)


def test_text_format_json_schema_json_object_and_sdk_parse(model):
    schema = SCHEMAS["nested_user"]

    async def scenario():
        async with client_and_stack(model) as (client, _):
            by_schema = await client.responses.create(
                **GREEDY, input="A user in JSON.", reasoning=NO_THINKING, max_output_tokens=150,
                text={"format": {"type": "json_schema", "name": "user", "schema": schema, "strict": True}})
            as_object = await client.responses.create(
                **GREEDY, input="Any JSON object.", reasoning=NO_THINKING, max_output_tokens=60,
                text={"format": {"type": "json_object"}})
            parsed = await client.responses.parse(**GREEDY, input="A person.", reasoning=NO_THINKING,
                                                  max_output_tokens=150, text_format=Person)
            return by_schema, as_object, parsed

    by_schema, as_object, parsed = asyncio.run(scenario())
    assert by_schema.status == "completed" and by_schema.text.format.type == "json_schema"
    parse_and_validate(by_schema.output_text, schema)
    assert as_object.status in ("completed", "incomplete") and as_object.output_text.startswith("{")
    if as_object.status == "completed":
        assert isinstance(json.loads(as_object.output_text), dict)
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, Person)


# ---- refusals and tolerance ---------------------------------------------------------------------------
REFUSED = [
    ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools[0].type", "file_search"),
    ({"tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]}, "tools[0].type", "code_interpreter"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "see"},
                                              {"type": "input_image", "image_url": "data:x", "detail": "auto"}]}]},
     "input[0].content[1]", "data URL"),  # a malformed data URL (issue 27: images are converted, not refused)
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file_1"}]}]},
     "input[0].content[0]", "input_file"),
    ({"input": [{"type": "local_shell_call", "id": "x", "call_id": "c", "status": "completed",
                 "action": {"type": "exec", "command": ["ls"], "env": {}}}]}, "input[0].type", "local_shell_call"),
    ({"input": [{"type": "message", "role": "critic", "content": "x"}]}, "input[0].role", "user"),
    ({"temperature": 3}, "temperature", "2"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "web_search_preview"}}, "tool_choice", "web_search_preview"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.json_schema.schema", "schema"),
    ({"conversation": "conv_1"}, "conversation", "previous_response_id"),
    ({"background": True}, "background", "background"),
    ({"previous_response_id": "resp_unknown"}, "previous_response_id", "resp_unknown"),
]


def test_refused_requests_name_the_field_and_unknown_fields_are_accepted(model):
    async def scenario():
        async with client_and_stack(model) as (_, stack):
            refused = [await stack.http.post("/v1/responses", json={**GREEDY, "input": "t1", **fields})
                       for fields, _, _ in REFUSED]
            tolerated = await stack.http.post("/v1/responses", json={
                **GREEDY, "input": "t1", "max_output_tokens": 2, "brand_new_field": {"a": 1}, "service_tier": "flex",
                "prompt_cache_key": "k", "safety_identifier": "s", "include": ["reasoning.encrypted_content"],
                "stream_options": {"include_obfuscation": False}, "max_tool_calls": 3,
                "context_management": [{"type": "compaction", "compact_threshold": 1000}],
                "tools": [{"type": "web_search", "external_web_access": False}, *TOOLS]})
            stats = (await stack.http.get("/v1/queue/stats")).json()
            return refused, tolerated, stats

    refused, tolerated, stats = asyncio.run(scenario())
    for (fields, param, words), response in zip(REFUSED, refused):
        assert response.status_code == 400, (fields, response.text)
        error = response.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error", (fields, error)
        assert words in error["message"], (fields, error)
    assert tolerated.status_code == 200, tolerated.text
    body = tolerated.json()
    Response.model_validate(body)
    assert [t["name"] for t in body["tools"]] == ["get_weather"]  # web_search is not offered to the model
    ignored = stats["ignored_fields"]
    assert ignored["responses.brand_new_field"] >= 1 and ignored["responses.context_management"] >= 1
    assert ignored["responses.tool:web_search"] >= 1


def test_a_codex_shaped_turn_streams_to_the_end(model):
    """What Codex CLI sends for a model it does not know (openai/codex: ResponsesApiRequest, the fallback model
    info): instructions, developer + user messages, function tools with strict false, its default cached web_search,
    tool_choice auto, reasoning with a summary, store false, include encrypted reasoning, a prompt_cache_key, no
    max_output_tokens (the model's default_max_tokens applies)."""
    shell = {"type": "function", "name": "exec_command", "description": "Runs a command", "strict": False,
             "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"],
                            "additionalProperties": False}}
    body = {
        "model": MODEL, "instructions": "You are Codex, a coding agent.", "stream": True, "store": False,
        "input": [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "<perms>"}]},
                  {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "say hello"}]}],
        "tools": [shell, {"type": "web_search", "external_web_access": False}], "tool_choice": "auto",
        "parallel_tool_calls": False, "reasoning": {"summary": "auto"}, "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "0199a0d5-conversation", "temperature": 0,
    }

    async def scenario():
        async with client_and_stack(model) as (_, stack):
            return await stack.http.post("/v1/responses", json=body, headers={"originator": "codex_exec"})

    response = asyncio.run(scenario())
    assert response.status_code == 200, response.text
    events = named_events(response.text)
    kinds = [e["type"] for e in events]
    assert follows_the_grammar(kinds) and kinds[-1] == "response.incomplete", kinds
    final = events[-1]["response"]
    # No max_output_tokens: the model's default_max_tokens (24) applies.
    assert final["usage"]["output_tokens"] == 24 and final["store"] is False and final["output"]
    assert [t["name"] for t in final["tools"]] == ["exec_command"]
