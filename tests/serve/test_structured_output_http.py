"""Structured output over HTTP with the real `openai` client: response_format, vLLM's guided_* extras, 400s.

The in-process stack serves a tiny random model that speaks SmolLM2's byte-level BPE vocabulary.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deployments.config import ModelConfig
from tests.serve.local_stack import local_stack
from tests.support.json_schemas import SCHEMAS, parse_and_validate
from tests.support.tiny_models import write_smollm2_tokenizer_model

MODEL = "tiny/bpe"
CHAT = [{"role": "user", "content": "Describe a person in JSON."}]


@pytest.fixture(scope="module")
def bpe_model(tmp_path_factory) -> ModelConfig:
    folder = write_smollm2_tokenizer_model(tmp_path_factory.mktemp("bpe-http"), config=dict(bos_token_id=1, eos_token_id=2),
                                           scale=4.0)
    return ModelConfig(model_id=MODEL, model_path=str(folder))


@contextlib.asynccontextmanager
async def openai_client(config: ModelConfig):
    async with local_stack([config]) as stack:
        yield openai.AsyncOpenAI(base_url="http://orchard/v1", api_key="unused", http_client=stack.http, max_retries=0)


def response_format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


def test_chat_json_schema_streamed_and_not(bpe_model):
    names = ["nested_user", "array_of_objects", "number_bounds"]

    async def scenario():
        async with openai_client(bpe_model) as client:
            whole = await asyncio.gather(*(
                client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=150, temperature=0.0,
                                               response_format=response_format(n)) for n in names))
            streams = []
            for name in names:
                chunks = [c async for c in await client.chat.completions.create(
                    model=MODEL, messages=CHAT, max_tokens=150, temperature=0.0, stream=True,
                    response_format=response_format(name))]
                streams.append(chunks)
            return whole, streams

    whole, streams = asyncio.run(scenario())
    for name, completion, chunks in zip(names, whole, streams):
        choice = completion.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        parse_and_validate(choice.message.content, SCHEMAS[name])
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == choice.message.content  # greedy: the same document, delivered in parts
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_json_object_choice_and_regex_on_both_endpoints(bpe_model):
    async def scenario():
        async with openai_client(bpe_model) as client:
            json_object = await client.chat.completions.create(
                model=MODEL, messages=CHAT, max_tokens=150, temperature=0.0, response_format={"type": "json_object"},
                logit_bias={"18": 30})  # '"': keep the random model's free-form strings short
            choice = await client.completions.create(
                model=MODEL, prompt="Is it raining?", max_tokens=10, temperature=0.0,
                extra_body={"guided_choice": ["yes", "no"]})
            regex = await client.chat.completions.create(
                model=MODEL, messages=CHAT, max_tokens=20, temperature=0.0,
                extra_body={"guided_regex": "[A-Z]{2}-[0-9]{4}"})
            schema = await client.completions.create(
                model=MODEL, prompt="A point:", max_tokens=100, temperature=0.7, seed=3,
                extra_body={"response_format": response_format("refs")})
            return json_object, choice, regex, schema

    json_object, choice, regex, schema = asyncio.run(scenario())
    assert json_object.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(json_object.choices[0].message.content), dict)
    assert choice.choices[0].text in ("yes", "no") and choice.choices[0].finish_reason == "stop"
    content = regex.choices[0].message.content
    assert len(content) == 7 and content[2] == "-" and content[:2].isupper() and content[3:].isdigit()
    assert schema.choices[0].finish_reason == "stop"
    parse_and_validate(schema.choices[0].text, SCHEMAS["refs"])


INVALID = [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}}},
     "response_format", "uniqueItems"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "integer", "minimum": 5, "maximum": 1}}}}, "response_format", "minimum 5"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "format": "color"}}}}, "response_format", "format 'color'"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ({"guided_regex": "(unclosed"}, "guided_regex", "constraint"),  # only the index build finds this one
    ({"guided_choice": []}, "guided_choice", "non-empty"),
    ({"guided_regex": "a+", "response_format": {"type": "json_object"}}, "guided_regex", "one output constraint"),
]
# Issue 48's reproductions (max_tokens 4): the first took the whole server down, the second answered 500 after 23 s,
# the third had no answer within 300 s. Now refused at submit, before any index is built.
HOSTILE = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "e", "schema": {
        "type": "string", "minLength": 10_000_000, "maxLength": 100_000_000}}}}, "response_format",
     "minLength 10,000,000 at # can never be met within max_tokens 4"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "e", "schema": {
        "type": "array", "items": {"type": "string"}, "minItems": 1_000_000, "maxItems": 10_000_000}}}},
     "response_format", "minItems 1,000,000 at # can never be met"),
    ({"guided_regex": "((a{100}){100}){100}"}, "guided_regex", "unroll to 1,000,000 positions, over the limit"),
]


def test_invalid_constraints_are_400s_naming_the_problem(bpe_model):
    async def scenario():
        errors = []
        async with openai_client(bpe_model) as client:
            for fields, _, _ in INVALID:
                with pytest.raises(openai.BadRequestError) as refused:
                    await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, extra_body=fields)
                errors.append(refused.value.body)
        return errors

    for (fields, param, words), body in zip(INVALID, asyncio.run(scenario())):
        assert body["param"] == param and body["type"] == "invalid_request_error", (fields, body)
        assert words in body["message"], (fields, body["message"])


def test_guide_compiles_are_counted_in_metrics(bpe_model):
    """A schema no guide was built for yet (a new property name) is one compile, its seconds counted in /metrics."""

    async def scenario():
        schema = {"type": "object", "properties": {f"p{uuid.uuid4().hex[:8]}": {"type": "integer"}}}
        body = {"model": MODEL, "messages": CHAT, "max_tokens": 3,
                "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}
        async with local_stack([bpe_model]) as stack:
            for _ in range(2):  # the second reuses the guide
                assert (await stack.http.post("/v1/chat/completions", json=body)).status_code == 200
            page = (await stack.http.get("/metrics")).text
        samples = {s.name: s.value for family in text_string_to_metric_families(page) for s in family.samples
                   if s.labels.get("model_name") == MODEL}
        assert samples["orchard:structured_output_compiles_total"] == 1
        assert samples["orchard:structured_output_compile_seconds_total"] > 0

    asyncio.run(scenario())


def test_the_reported_hostile_constraints_are_400s_before_any_compile(bpe_model):
    async def scenario():
        errors = []
        async with local_stack([bpe_model]) as stack:
            client = openai.AsyncOpenAI(base_url="http://orchard/v1", api_key="unused", http_client=stack.http,
                                        max_retries=0)
            for fields, _, _ in HOSTILE:
                with pytest.raises(openai.BadRequestError) as refused:
                    await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, extra_body=fields)
                errors.append(refused.value.body)
            health = await stack.http.get("/health")
            page = (await stack.http.get("/metrics")).text
        compiles = [s.value for family in text_string_to_metric_families(page) for s in family.samples
                    if s.name == "orchard:structured_output_compiles_total" and s.labels.get("model_name") == MODEL]
        return errors, health.status_code, compiles

    errors, health, compiles = asyncio.run(scenario())
    for (fields, param, words), body in zip(HOSTILE, errors):
        assert body["param"] == param and body["type"] == "invalid_request_error", (fields, body)
        assert words in body["message"], (fields, body["message"])
    assert health == 200 and compiles == [0]
