"""Bad requests over HTTP (in-process stack, real engines): 400 in each API's shape naming the field, never a dead
engine. Lone surrogates, 32-bit bounds, the counts of messages, tools and stop strings, and the lengths of the ids
and metadata a response echoes."""

from __future__ import annotations

import asyncio
import json

import anthropic
import httpx2
import openai
import pytest

from deployments.api.request_limits import (
    MAX_ID_CHARS,
    MAX_MESSAGES,
    MAX_METADATA_KEY_CHARS,
    MAX_METADATA_PAIRS,
    MAX_METADATA_VALUE_CHARS,
    MAX_STOP_STRINGS,
    MAX_SYSTEM_BLOCKS,
    MAX_TOOLS,
    refuse_invalid_unicode,
)
from deployments.config import ModelConfig
from deployments.ingress.routes import create_app
from engine.errors import InvalidRequestError
from tests.serve.local_stack import LocalStack, local_stack

MODEL = "tiny/alpha"
USER = [{"role": "user", "content": "t1 t2 t3"}]
OPENAI_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
ANTHROPIC_TOOL = {"name": "f", "input_schema": {"type": "object"}}
LONE = "t1 \ud800 t2"  # json.dumps writes it as the escape "\ud800", which json.loads turns back into a lone surrogate


@pytest.fixture()
def alpha(tiny_models) -> ModelConfig:
    return ModelConfig(model_id=MODEL, model_path=str(tiny_models.alpha), context_length=512)


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": USER, "max_tokens": 4, "temperature": 0, **fields}


def messages(**fields) -> dict:
    return {"model": MODEL, "messages": USER, "max_tokens": 4, **fields}


def responses(**fields) -> dict:
    return {"model": MODEL, "input": "t1 t2 t3", "max_output_tokens": 4, "temperature": 0, **fields}


async def post(stack: LocalStack, path: str, body: dict):
    # Sent as ASCII JSON: the surrogate travels as its escape, as a client's JSON encoder sends it.
    return await stack.http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


def assert_openai_400(response, param: str, *words: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["code"] is None
    assert all(word in error["message"] for word in words), error["message"]


def assert_anthropic_400(response, param: str, *words: str) -> None:
    assert response.status_code == 400, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert all(word in body["error"]["message"] for word in (param, *words)), body["error"]["message"]


# ---- text that is not valid Unicode -----------------------------------------------------------------------
OPENAI_SURROGATES = [
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": LONE}]), "messages.0.content"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": [{"type": "text", "text": LONE}]}]),
     "messages.0.content.0.text"),
    ("/v1/chat/completions", chat(tools=[{**OPENAI_TOOL, "function": {"name": "f", "description": LONE}}]),
     "tools.0.function.description"),
    ("/v1/chat/completions", chat(stop=["x", LONE]), "stop.1"),
    ("/v1/chat/completions", chat(model=LONE), "model"),
    ("/v1/chat/completions", chat(metadata={LONE: "x"}), "metadata"),  # in a key
    ("/v1/completions", {"model": MODEL, "prompt": LONE, "max_tokens": 4}, "prompt"),
]
ANTHROPIC_SURROGATES = [
    ("/v1/messages", messages(messages=[{"role": "user", "content": LONE}]), "messages.0.content"),
    ("/v1/messages", messages(system=[{"type": "text", "text": LONE}]), "system.0.text"),
    ("/v1/messages", messages(stop_sequences=[LONE]), "stop_sequences.0"),
    ("/v1/messages/count_tokens", {"model": MODEL, "messages": [{"role": "user", "content": LONE}]},
     "messages.0.content"),
    ("/v1/messages/count_tokens",
     {"model": MODEL, "messages": USER, "tools": [{**ANTHROPIC_TOOL, "input_schema": {"type": "object", LONE: 1}}]},
     "tools.0.input_schema"),
]


def test_lone_surrogates_are_400_naming_the_field_and_the_model_keeps_serving(alpha):
    async def scenario():
        async with local_stack([alpha]) as stack:
            answers = [await post(stack, path, body) for path, body, _ in OPENAI_SURROGATES + ANTHROPIC_SURROGATES]
            after = [await post(stack, "/v1/chat/completions", chat()), await post(stack, "/v1/messages", messages())]
            return answers, after

    answers, after = asyncio.run(scenario())
    for (_, _, param), response in zip(OPENAI_SURROGATES, answers):
        assert_openai_400(response, param, "not valid Unicode")
    for (_, _, param), response in zip(ANTHROPIC_SURROGATES, answers[len(OPENAI_SURROGATES):]):
        assert_anthropic_400(response, param, "not valid Unicode")
    assert [r.status_code for r in after] == [200, 200]


def test_real_clients_get_bad_request_errors_naming_the_field(alpha):
    """(The SDKs cannot send a lone surrogate at all: their JSON encoders refuse it. Hand-written JSON can.)"""
    async def scenario():
        async with local_stack([alpha]) as stack:
            oai = openai.AsyncOpenAI(base_url="http://orchard/v1", api_key="unused", http_client=stack.http, max_retries=0)
            # The anthropic SDK speaks httpx2: its own in-process transport over the same registry.
            http2 = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=create_app(stack.registry)))
            ant = anthropic.AsyncAnthropic(base_url="http://orchard", api_key="unused", http_client=http2, max_retries=0)
            with pytest.raises(openai.BadRequestError) as openai_error:
                await oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, extra_body={"top_k": 2**31})
            with pytest.raises(anthropic.BadRequestError) as anthropic_error:
                await ant.messages.create(model=MODEL, messages=USER, max_tokens=4,
                                          stop_sequences=["x"] * (MAX_STOP_STRINGS + 1))
            served = await oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=4)
            return openai_error.value, anthropic_error.value, served

    openai_error, anthropic_error, served = asyncio.run(scenario())
    assert openai_error.status_code == 400 and openai_error.body["param"] == "top_k"
    assert anthropic_error.status_code == 400 and "stop_sequences" in anthropic_error.body["error"]["message"]
    assert served.choices[0].finish_reason == "length"


# ---- top_k ----------------------------------------------------------------------------------------------------
def test_top_k_beyond_int32_is_400_and_above_the_vocabulary_keeps_every_token(alpha):
    sampled = {"temperature": 1.5, "seed": 7, "max_tokens": 12, "ignore_eos": True}

    async def scenario():
        async with local_stack([alpha]) as stack:
            refused = [await post(stack, "/v1/chat/completions", chat(top_k=2**31)),
                       await post(stack, "/v1/messages", messages(top_k=2**31))]
            texts = []
            for top_k in (0, 300, 100_000, 2**31 - 1):  # the tiny model has 256 tokens
                response = await post(stack, "/v1/chat/completions", chat(top_k=top_k, **sampled))
                assert response.status_code == 200, response.text
                texts.append(response.json()["choices"][0]["message"]["content"])
            return refused, texts

    refused, texts = asyncio.run(scenario())
    assert_openai_400(refused[0], "top_k", "2147483647")
    assert_anthropic_400(refused[1], "top_k", "2147483647")
    assert texts[0] and texts == [texts[0]] * 4


# ---- counts ----------------------------------------------------------------------------------------------------
OPENAI_COUNTS = [
    (chat(messages=USER * (MAX_MESSAGES + 1)), "messages", f"at most {MAX_MESSAGES}"),
    (chat(tools=[OPENAI_TOOL] * (MAX_TOOLS + 1)), "tools", f"at most {MAX_TOOLS}"),
    (chat(stop=["x"] * (MAX_STOP_STRINGS + 1)), "stop", f"at most {MAX_STOP_STRINGS}"),
]
ANTHROPIC_COUNTS = [
    (messages(messages=USER * (MAX_MESSAGES + 1)), "messages", f"at most {MAX_MESSAGES}"),
    (messages(tools=[ANTHROPIC_TOOL] * (MAX_TOOLS + 1)), "tools", f"at most {MAX_TOOLS}"),
    (messages(stop_sequences=["x"] * (MAX_STOP_STRINGS + 1)), "stop_sequences", f"at most {MAX_STOP_STRINGS}"),
    (messages(system=[{"type": "text", "text": "x"}] * (MAX_SYSTEM_BLOCKS + 1)), "system", f"at most {MAX_SYSTEM_BLOCKS}"),
]


def test_too_many_messages_tools_or_stop_strings_are_400_naming_the_field(alpha):
    async def scenario():
        async with local_stack([alpha]) as stack:
            openai_answers = [await post(stack, "/v1/chat/completions", body) for body, _, _ in OPENAI_COUNTS]
            anthropic_answers = [await post(stack, "/v1/messages", body) for body, _, _ in ANTHROPIC_COUNTS]
            return openai_answers, anthropic_answers

    openai_answers, anthropic_answers = asyncio.run(scenario())
    for (_, param, words), response in zip(OPENAI_COUNTS, openai_answers):
        assert_openai_400(response, param, words)
    for (_, param, words), response in zip(ANTHROPIC_COUNTS, anthropic_answers):
        assert_anthropic_400(response, param, words)


def test_counts_at_the_limits_are_accepted(alpha):
    async def scenario():
        async with local_stack([alpha]) as stack:
            counted = await post(stack, "/v1/messages/count_tokens", {
                "model": MODEL, "messages": [{"role": "user", "content": "t1"}] * MAX_MESSAGES,
                "tools": [{**ANTHROPIC_TOOL, "name": f"f{i}"} for i in range(MAX_TOOLS)],
                "system": [{"type": "text", "text": "t2"}] * MAX_SYSTEM_BLOCKS,
            })
            stopped = await post(stack, "/v1/chat/completions", chat(stop=[f"x{i}" for i in range(MAX_STOP_STRINGS)]))
            sequences = await post(stack, "/v1/messages", messages(stop_sequences=["x"] * MAX_STOP_STRINGS))
            return counted, stopped, sequences

    counted, stopped, sequences = asyncio.run(scenario())
    assert counted.status_code == 200 and counted.json()["input_tokens"] > MAX_MESSAGES, counted.text
    assert stopped.status_code == 200 and sequences.status_code == 200


# ---- lengths of echoed ids and metadata (issue 59) ----------------------------------------------------------------
SEVEN_MB = "u" * 7_000_000  # the issue's: each such field grew the Responses store by 7 MB per stored response
AT_ID_LIMIT = "i" * MAX_ID_CHARS
TOO_MANY_PAIRS = {f"k{i}": "v" for i in range(MAX_METADATA_PAIRS + 1)}
METADATA_AT_LIMITS = {f"{i:0{MAX_METADATA_KEY_CHARS}d}": "v" * MAX_METADATA_VALUE_CHARS
                      for i in range(MAX_METADATA_PAIRS)}
ALLOWED_TOOLS = {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "mcp", "name": SEVEN_MB}]}
# Claude Code 2.1's metadata.user_id (tests/fixtures/agents/claude_code): a JSON string of 150 characters.
CLAUDE_CODE_USER_ID = ('{"device_id":"001c679cfd641a6ea2f7c9377e0d6740bf5cc13d1c7260cbb063b2567dc2aeb4",'
                       '"account_uuid":"","session_id":"fafe0f38-061c-4581-ab1c-30aec7382490"}')
OPENAI_LENGTHS = [
    ("/v1/responses", responses(user=SEVEN_MB), "user", f"at most {MAX_ID_CHARS} characters"),
    ("/v1/responses", responses(prompt_cache_key=SEVEN_MB), "prompt_cache_key", f"at most {MAX_ID_CHARS} characters"),
    ("/v1/responses", responses(safety_identifier=SEVEN_MB), "safety_identifier", f"at most {MAX_ID_CHARS}"),
    ("/v1/responses", responses(previous_response_id=SEVEN_MB), "previous_response_id", f"at most {MAX_ID_CHARS}"),
    ("/v1/responses", responses(service_tier=AT_ID_LIMIT + "x"), "service_tier", f"at most {MAX_ID_CHARS}"),
    ("/v1/responses", responses(metadata=TOO_MANY_PAIRS), "metadata", f"at most {MAX_METADATA_PAIRS} key-value"),
    ("/v1/responses", responses(metadata={SEVEN_MB: "v"}), "metadata", f"at most {MAX_METADATA_KEY_CHARS} are"),
    ("/v1/responses", responses(metadata={"k": SEVEN_MB}), "metadata.k", f"at most {MAX_METADATA_VALUE_CHARS}"),
    ("/v1/responses", responses(tool_choice=ALLOWED_TOOLS), "tool_choice.tools[0].name", f"at most {MAX_ID_CHARS}"),
    ("/v1/chat/completions", chat(user=SEVEN_MB), "user", f"at most {MAX_ID_CHARS} characters"),
    ("/v1/chat/completions", chat(metadata=TOO_MANY_PAIRS), "metadata", f"at most {MAX_METADATA_PAIRS} key-value"),
    ("/v1/chat/completions", chat(metadata={"k" * (MAX_METADATA_KEY_CHARS + 1): "v"}), "metadata",
     f"at most {MAX_METADATA_KEY_CHARS} are"),
    ("/v1/chat/completions", chat(metadata={"k": "v" * (MAX_METADATA_VALUE_CHARS + 1)}), "metadata.k",
     f"at most {MAX_METADATA_VALUE_CHARS}"),
    ("/v1/completions", {"model": MODEL, "prompt": "t1", "max_tokens": 4, "user": SEVEN_MB}, "user",
     f"at most {MAX_ID_CHARS} characters"),
]
ANTHROPIC_LENGTHS = [
    (messages(metadata={"user_id": SEVEN_MB}), "metadata.user_id", f"at most {MAX_ID_CHARS} characters"),
    (messages(service_tier=SEVEN_MB), "service_tier", f"at most {MAX_ID_CHARS} characters"),
    (messages(container=SEVEN_MB), "container", f"at most {MAX_ID_CHARS} characters"),
]


def test_long_echoed_ids_and_metadata_are_400_naming_the_field(alpha):
    """Issue 59's reproduction: a 7 MB user, prompt_cache_key or safety_identifier was answered, echoed and stored
    (~23 MB of ingress memory per response); now each is a 400 naming it, in each API's shape, and none quotes the
    string back."""
    async def scenario():
        async with local_stack([alpha]) as stack:
            openai_answers = [await post(stack, path, body) for path, body, _, _ in OPENAI_LENGTHS]
            anthropic_answers = [await post(stack, "/v1/messages", body) for body, _, _ in ANTHROPIC_LENGTHS]
            return openai_answers, anthropic_answers

    openai_answers, anthropic_answers = asyncio.run(scenario())
    for (_, _, param, words), response in zip(OPENAI_LENGTHS, openai_answers):
        assert len(response.content) < 2_000, response.content[:300]  # first: a failure would quote 7 MB
        assert_openai_400(response, param, words)
    for (_, param, words), response in zip(ANTHROPIC_LENGTHS, anthropic_answers):
        assert len(response.content) < 2_000, response.content[:300]
        assert_anthropic_400(response, param, words)


def test_ids_and_metadata_at_the_limits_are_accepted_and_echoed(alpha):
    ids = {"user": AT_ID_LIMIT, "prompt_cache_key": AT_ID_LIMIT, "safety_identifier": AT_ID_LIMIT}

    async def scenario():
        async with local_stack([alpha]) as stack:
            answered = await post(stack, "/v1/responses", responses(**ids, metadata=METADATA_AT_LIMITS))
            stored = await stack.http.get(f"/v1/responses/{answered.json()['id']}")
            chained = await post(stack, "/v1/responses", responses(previous_response_id=answered.json()["id"]))
            chatted = await post(stack, "/v1/chat/completions", chat(user=AT_ID_LIMIT, metadata=METADATA_AT_LIMITS))
            claude = await post(stack, "/v1/messages", messages(metadata={"user_id": CLAUDE_CODE_USER_ID}))
            at_limit = await post(stack, "/v1/messages", messages(metadata={"user_id": AT_ID_LIMIT},
                                                                   service_tier=AT_ID_LIMIT, container=AT_ID_LIMIT))
            return answered, stored, chained, chatted, claude, at_limit

    answered, stored, chained, *others = asyncio.run(scenario())
    assert answered.status_code == 200 and stored.status_code == 200, (answered.text[:300], stored.text[:300])
    for response in (answered.json(), stored.json()):
        assert {name: response[name] for name in ids} == ids and response["metadata"] == METADATA_AT_LIMITS
    assert chained.status_code == 200 and chained.json()["previous_response_id"] == answered.json()["id"]
    assert [r.status_code for r in others] == [200, 200, 200], [r.text[:300] for r in others]


def test_the_openapi_spec_states_the_bounds(alpha):
    async def scenario():
        async with local_stack([alpha]) as stack:
            return (await stack.http.get("/openapi.json")).json()["components"]["schemas"]

    schemas = asyncio.run(scenario())
    chat_fields = schemas["ChatCompletionRequest"]["properties"]
    messages_fields = schemas["MessagesRequest"]["properties"]
    assert chat_fields["messages"]["maxItems"] == MAX_MESSAGES
    assert messages_fields["stop_sequences"]["anyOf"][0]["maxItems"] == MAX_STOP_STRINGS
    assert {"type": "array", "items": {"type": "string"}, "maxItems": MAX_STOP_STRINGS} in chat_fields["stop"]["anyOf"]
    for fields in (chat_fields, messages_fields):
        assert fields["top_k"]["anyOf"][0]["maximum"] == 2**31 - 1
        assert fields["tools"]["anyOf"][0]["maxItems"] == MAX_TOOLS
    responses_fields = schemas["ResponsesRequest"]["properties"]
    for fields, name in [(responses_fields, "user"), (responses_fields, "prompt_cache_key"),
                         (responses_fields, "safety_identifier"), (chat_fields, "user")]:
        assert fields[name]["anyOf"][0]["maxLength"] == MAX_ID_CHARS, name
    assert schemas["Metadata"]["properties"]["user_id"]["anyOf"][0]["maxLength"] == MAX_ID_CHARS


def test_the_unicode_check_names_the_path_and_survives_deep_nesting():
    deep: object = ["t1", {"k": "\udfff"}]
    for _ in range(50_000):  # deeper than Python's recursion limit: the walk is a loop
        deep = [deep]
    with pytest.raises(InvalidRequestError) as info:
        refuse_invalid_unicode({"model": "m", "chat_template_kwargs": {"x": deep}})
    assert info.value.param == "chat_template_kwargs.x" + ".0" * 50_000 + ".1.k"
    body = {"messages": [{"role": "user", "content": "é 日本 🙂"}]}  # valid non-ASCII passes untouched
    assert refuse_invalid_unicode(body) is body


# ---- the KV budget ------------------------------------------------------------------------------------------
KV_BYTES_PER_TOKEN = 512  # the tiny llama: 2 layers x 2 KV heads x 16 dims x 4 bytes (float32) x keys and values
KV_BUDGET_TOKENS = 64  # past the cache's allocation step of 256 positions


def test_a_request_whose_kv_cannot_fit_the_budget_is_400_naming_the_numbers(tiny_models):
    budget = (256 + KV_BUDGET_TOKENS) * KV_BYTES_PER_TOKEN
    config = ModelConfig(model_id=MODEL, model_path=str(tiny_models.alpha), context_length=512, kv_budget_bytes=budget)

    async def scenario():
        async with local_stack([config]) as stack:
            too_big = await post(stack, "/v1/chat/completions", chat(max_tokens=KV_BUDGET_TOKENS))
            long_prompt = {"role": "user", "content": " ".join(["t1"] * 80)}
            anthropic_too_big = await post(stack, "/v1/messages", messages(messages=[long_prompt]))
            # Without max_tokens (and Anthropic's) a request gets the room the budget leaves, like the context's.
            unbounded = await post(stack, "/v1/chat/completions", chat(max_tokens=None, ignore_eos=True))
            anthropic = await post(stack, "/v1/messages", messages(max_tokens=KV_BUDGET_TOKENS))
            return too_big, anthropic_too_big, unbounded, anthropic

    too_big, anthropic_too_big, unbounded, anthropic = asyncio.run(scenario())
    assert too_big.status_code == 400, too_big.text
    error = too_big.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "max_tokens"
    assert error["code"] == "kv_budget_exceeded"
    assert f"+ {KV_BUDGET_TOKENS} to generate) at {KV_BYTES_PER_TOKEN} bytes per token" in error["message"]
    assert f"KV budget is {budget} bytes (at most {KV_BUDGET_TOKENS} tokens for one request)" in error["message"]
    assert_anthropic_400(anthropic_too_big, "messages", "85 in the prompt", f"KV budget is {budget} bytes")
    assert unbounded.status_code == 200 and anthropic.status_code == 200, (unbounded.text, anthropic.text)
    usage = unbounded.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == KV_BUDGET_TOKENS
    assert unbounded.json()["choices"][0]["finish_reason"] == "length"


def test_template_call_parameters_in_chat_template_kwargs_are_400s(alpha):
    """chat_template_kwargs sets the template's variables; a key that is a parameter of the template call itself
    ("chat_template" would swap in the client's own Jinja) is refused, naming it; a variable still works."""
    swap = {"chat_template": "{% for i in range(99999999) %}x{% endfor %}"}

    async def scenario():
        async with local_stack([alpha]) as stack:
            return [await post(stack, "/v1/chat/completions", chat(chat_template_kwargs=swap)),
                    await post(stack, "/v1/messages", messages(chat_template_kwargs={"tokenize": True})),
                    await post(stack, "/v1/chat/completions", chat(chat_template_kwargs={"enable_thinking": False}))]

    swapped, tokenize, variable = asyncio.run(scenario())
    assert_openai_400(swapped, "chat_template_kwargs.chat_template", "not a template variable")
    assert_anthropic_400(tokenize, "chat_template_kwargs.tokenize", "not a template variable")
    assert variable.status_code == 200, variable.text
