"""Tools on every model, over the in-process stack with the real openai and anthropic clients.

A tiny random model speaks SmolLM2's real tokenizer: once with SmolLM2's own template (no tool format: the generic
one applies) and once with Qwen3's tool template (the qwen3 parser). A random model writes a valid call only through
the forced-call regex (tool_choice required / named), so those are what these tests drive. The slow test asks the
real SmolLM2.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import anthropic
import httpx2
import jsonschema
import openai
import pytest

from deployments.chat.generic_tools import tools_block
from deployments.chat.parsers.forced import forced_call_regex
from deployments.chat.parsers.selection import ParserNames
from deployments.chat.prompts import PromptEncoder
from deployments.config import ModelConfig
from deployments.model_calls import ChatPrompt
from engine.errors import InvalidRequestError
from engine.models.loader import load_tokenizer_only
from tests.serve.local_stack import local_stack
from tests.support.tiny_models import write_smollm2_tokenizer_model
from tests.unit.test_generic_tools import LONG_TOOL

REPO = Path(__file__).resolve().parents[2]
QWEN3_TEMPLATE = REPO / "tests" / "support" / "qwen3_tools.jinja"
BARE = "tiny/bare"  # SmolLM2's ChatML template: no tool format
QWEN = "tiny/qwen3-tools"
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Berlin", "Tokyo"]},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": WEATHER_SCHEMA}}
NOTE = {"type": "function", "function": {"name": "take_note", "parameters": {
    "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}
ANTHROPIC_WEATHER = {"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER_SCHEMA}
QUESTION = "What is the weather in Paris?"
USER = [{"role": "user", "content": QUESTION}]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    return write_smollm2_tokenizer_model(tmp_path_factory.mktemp("tools-local") / "model",
                                         {"max_position_embeddings": 4096}, seed=1, scale=3.0)


def bare(folder: Path) -> ModelConfig:
    return ModelConfig(model_id=BARE, model_path=str(folder), context_length=1536)


def qwen(folder: Path) -> ModelConfig:
    return ModelConfig(model_id=QWEN, model_path=str(folder), context_length=1536,
                       chat_template_file=str(QWEN3_TEMPLATE))


@dataclass
class Clients:
    openai: openai.AsyncOpenAI
    anthropic: anthropic.AsyncAnthropic


@contextlib.asynccontextmanager
async def clients(*configs: ModelConfig):
    async with local_stack(list(configs)) as stack:
        http2 = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=stack.app))  # the anthropic SDK speaks httpx2
        yield Clients(
            openai.AsyncOpenAI(base_url="http://orchard/v1", api_key="unused", http_client=stack.http, max_retries=0),
            anthropic.AsyncAnthropic(base_url="http://orchard", api_key="unused", http_client=http2, max_retries=0),
        )


def chatml(*turns: tuple[str, str]) -> str:
    """SmolLM2's template: each turn in ChatML, then the assistant's generation prompt."""
    return "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns) + "<|im_start|>assistant\n"


# ---- OpenAI / Anthropic turns, whole and streamed --------------------------------------------------------
@dataclass
class OpenAITurn:
    content: str | None
    tool_calls: list[dict]  # without ids (fresh per request)
    finish_reason: str
    completion_tokens: int


async def openai_turn(client: openai.AsyncOpenAI, stream: bool, **request) -> OpenAITurn:
    request = {**GREEDY, **request}
    if not stream:
        response = await client.chat.completions.create(**request)
        message = response.choices[0].message
        calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls or []]
        assert all(c.id.startswith("call_") and c.type == "function" for c in message.tool_calls or [])
        return OpenAITurn(message.content, calls, response.choices[0].finish_reason, response.usage.completion_tokens)
    chunks = [c async for c in await client.chat.completions.create(
        **request, stream=True, stream_options={"include_usage": True})]
    content, calls, reason = "", {}, None
    for chunk in chunks[:-1]:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        reason = chunk.choices[0].finish_reason or reason
        for part in delta.tool_calls or []:
            if part.index not in calls:  # a call's first delta: id, name, empty arguments
                assert part.id.startswith("call_") and part.function.arguments == ""
                calls[part.index] = {"name": part.function.name, "arguments": ""}
            else:
                calls[part.index]["arguments"] += part.function.arguments
    return OpenAITurn(content or None, [calls[i] for i in sorted(calls)], reason, chunks[-1].usage.completion_tokens)


async def anthropic_turn(client: anthropic.AsyncAnthropic, stream: bool, **request) -> tuple[dict, list[str]]:
    """The message (tool_use ids blanked) and, streamed, the event types."""
    request = {"extra_body": GREEDY, **request}
    if stream:
        async with client.messages.stream(**request) as events:
            kinds = [event.type async for event in events]
            message = await events.get_final_message()
    else:
        message, kinds = await client.messages.create(**request), []
    body = message.model_dump(exclude={"id"})
    usage = body["usage"]  # the prefix cache splits the prompt differently from one request to the next
    usage["input_tokens"] += usage.pop("cache_read_input_tokens")
    for block in body["content"]:
        if block["type"] == "tool_use":
            assert block["id"].startswith("toolu_")
            block["id"] = None
    return body, kinds


# ---- the generic format's prompt ------------------------------------------------------------------------
def test_tools_on_a_template_without_tools_are_described_in_the_system_prompt(model_folder):
    tokenizer = load_tokenizer_only(model_folder)
    prompt = ChatPrompt(messages=USER, tools=[WEATHER])
    # SmolLM2's template ignores `tools`: given to it, they would vanish from the prompt.
    assert "get_weather" not in PromptEncoder(tokenizer).encode(prompt).text
    expected = chatml(("system", tools_block([WEATHER], "auto", None)), ("user", QUESTION))
    assert PromptEncoder(tokenizer, tools_in_system_prompt=True).encode(prompt).text == expected
    assert ('<tools>\n{"name": "get_weather", "description": "Current weather in a city", "parameters": '
            + json.dumps(WEATHER_SCHEMA) + "}\n</tools>") in expected
    with_system = ChatPrompt(messages=[{"role": "system", "content": "Be brief."}, *USER], tools=[WEATHER])
    assert PromptEncoder(tokenizer, tools_in_system_prompt=True).encode(with_system).text == chatml(
        ("system", "Be brief.\n\n" + tools_block([WEATHER], "auto", None)), ("user", QUESTION))
    expected_tokens = len(tokenizer.encode(expected, add_special_tokens=False))

    async def scenario():
        async with clients(bare(model_folder)) as c:
            counted = await c.anthropic.messages.count_tokens(model=BARE, messages=USER, tools=[ANTHROPIC_WEATHER])
            auto = await c.openai.chat.completions.create(model=BARE, messages=USER, tools=[WEATHER], max_tokens=4,
                                                          **GREEDY)
            none = await c.openai.chat.completions.create(model=BARE, messages=USER, tools=[WEATHER], max_tokens=4,
                                                          tool_choice="none", **GREEDY)
            return counted, auto, none

    counted, auto, none = asyncio.run(scenario())
    assert counted.input_tokens == expected_tokens and auto.usage.prompt_tokens == expected_tokens
    # tool_choice "none": the model is not shown the tools (SmolLM2's default system prompt stays).
    default_system = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    assert none.usage.prompt_tokens == len(tokenizer.encode(chatml(("system", default_system), ("user", QUESTION)),
                                                            add_special_tokens=False))


# A template that refuses a system turn, as Gemma's does.
NO_SYSTEM_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def test_a_template_that_refuses_system_turns_gets_the_tools_in_the_first_user_turn(model_folder, tmp_path):
    (tmp_path / "no_system.jinja").write_text(NO_SYSTEM_TEMPLATE)
    tokenizer = load_tokenizer_only(model_folder, chat_template_file=tmp_path / "no_system.jinja")
    encoder = PromptEncoder(tokenizer, tools_in_system_prompt=True)
    block = tools_block([WEATHER], "required", None)
    assert encoder.encode(ChatPrompt(USER, [WEATHER], tool_choice="required")).text == (
        f"<start_of_turn>user\n{block}\n\n{QUESTION}<end_of_turn>\n<start_of_turn>model\n")
    with pytest.raises(InvalidRequestError) as refused:  # the client's own system turn: the template's own error
        encoder.encode(ChatPrompt([{"role": "system", "content": "Be brief."}, *USER], [WEATHER]))
    assert refused.value.param == "messages" and "System role not supported" in refused.value.message


# ---- forced calls ------------------------------------------------------------------------------------------
OPENAI_CHOICES = {"required": "required", "named": {"type": "function", "function": {"name": "get_weather"}}}
ANTHROPIC_CHOICES = {"any": {"type": "any"}, "named": {"type": "tool", "name": "get_weather"}}


@pytest.mark.parametrize("model", [BARE, QWEN])
def test_forced_calls_end_with_the_call_in_both_apis_streamed_as_whole(model_folder, model):
    max_tokens = 400

    async def scenario():
        async with clients(bare(model_folder) if model == BARE else qwen(model_folder)) as c:
            turns = {}
            for name, choice in OPENAI_CHOICES.items():
                for stream in (False, True):
                    turns["openai", name, stream] = await openai_turn(
                        c.openai, stream, model=model, messages=USER, tools=[WEATHER], tool_choice=choice,
                        max_tokens=max_tokens)
            for name, choice in ANTHROPIC_CHOICES.items():
                for stream in (False, True):
                    turns["anthropic", name, stream] = await anthropic_turn(
                        c.anthropic, stream, model=model, messages=USER, tools=[ANTHROPIC_WEATHER], tool_choice=choice,
                        max_tokens=max_tokens)
            return turns

    turns = asyncio.run(scenario())
    for name in OPENAI_CHOICES:
        whole, streamed = turns["openai", name, False], turns["openai", name, True]
        assert whole == streamed, (name, whole, streamed)
        assert whole.finish_reason == "tool_calls" and whole.content is None, whole
        (call,) = whole.tool_calls
        assert call["name"] == "get_weather"
        jsonschema.validate(json.loads(call["arguments"]), WEATHER_SCHEMA)
        # The request ends with the call: nowhere near max_tokens.
        assert whole.completion_tokens < max_tokens // 4, whole
    for name in ANTHROPIC_CHOICES:
        (whole, _), (streamed, kinds) = turns["anthropic", name, False], turns["anthropic", name, True]
        assert whole == streamed, (name, whole, streamed)
        assert whole["stop_reason"] == "tool_use" and whole["usage"]["output_tokens"] < max_tokens // 4, whole
        (use,) = whole["content"]
        assert use["type"] == "tool_use" and use["name"] == "get_weather"
        jsonschema.validate(use["input"], WEATHER_SCHEMA)
        assert kinds[:1] == ["message_start"] and "content_block_start" in kinds
        assert kinds[-2:] == ["message_delta", "message_stop"]


# ---- a call cut by max_tokens ------------------------------------------------------------------------------
CUT_AT = 40


def test_a_call_cut_by_max_tokens_is_partial_in_openai_and_left_out_in_anthropic(model_folder):
    """OpenAI: finish_reason length and the call with its arguments as far as they were written. Anthropic:
    stop_reason max_tokens and no tool_use block (half an input matches no schema, and must not be run)."""
    tokenizer = load_tokenizer_only(model_folder)
    prompt = ChatPrompt(messages=USER, tools=[NOTE], tool_choice="function", tool_name="take_note")
    prompt_text = PromptEncoder(tokenizer, tools_in_system_prompt=True).encode(prompt).text
    regex = forced_call_regex(ParserNames("generic"), [NOTE], "take_note")
    named = {"type": "function", "function": {"name": "take_note"}}

    async def scenario():
        async with clients(bare(model_folder)) as c:
            # The raw text the model writes for this prompt under the same constraint (no parser on /v1/completions).
            raw = await c.openai.completions.create(model=BARE, prompt=prompt_text, max_tokens=CUT_AT,
                                                    extra_body={"guided_regex": regex}, **GREEDY)
            turns = [await openai_turn(c.openai, stream, model=BARE, messages=USER, tools=[NOTE], tool_choice=named,
                                       max_tokens=CUT_AT) for stream in (False, True)]
            tool = {"name": "take_note", "input_schema": NOTE["function"]["parameters"]}
            messages = [await anthropic_turn(c.anthropic, stream, model=BARE, messages=USER, tools=[tool],
                                             tool_choice={"type": "tool", "name": "take_note"}, max_tokens=CUT_AT)
                        for stream in (False, True)]
            return raw, turns, messages

    raw, (whole, streamed), ((message, _), (streamed_message, kinds)) = asyncio.run(scenario())
    text = raw.choices[0].text
    assert raw.choices[0].finish_reason == "length" and raw.usage.completion_tokens == CUT_AT
    head = re.match(r'<tool_call>\n\{ ?"name" ?: ?"take_note" ?, ?"arguments" ?: ?', text)
    assert head is not None and len(text) > head.end() and not text.endswith("</tool_call>"), text  # cut inside
    assert whole == streamed == OpenAITurn(None, [{"name": "take_note", "arguments": text[head.end():]}], "length",
                                           CUT_AT)
    assert message == streamed_message
    assert message["content"] == [] and message["stop_reason"] == "max_tokens", message
    assert message["usage"]["output_tokens"] == CUT_AT
    assert "content_block_start" not in kinds and kinds[-2:] == ["message_delta", "message_stop"]


# ---- a tool loop's history ---------------------------------------------------------------------------------
def test_a_tool_loop_history_renders_on_a_template_without_tools(model_folder):
    arguments = {"city": "Paris", "unit": "celsius"}
    openai_history = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(arguments)}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    anthropic_history = [*USER, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": arguments}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C, sunny"}]}]
    call_text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    turns = [("user", QUESTION), ("assistant", call_text), ("user", "<tool_response>\n18 C, sunny\n</tool_response>")]
    tokenizer = load_tokenizer_only(model_folder)
    with_tools = chatml(("system", tools_block([WEATHER], "auto", None)), *turns)
    # Without tools (a last turn that offers none), the history still reads as calls and results.
    without_tools = chatml(("system", "You are a helpful AI assistant named SmolLM, trained by Hugging Face"), *turns)
    template_messages = [*USER, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]  # as api/openai_convert.py shapes them
    encoder = PromptEncoder(tokenizer, tools_in_system_prompt=True)
    assert encoder.encode(ChatPrompt(template_messages, [WEATHER])).text == with_tools
    assert encoder.encode(ChatPrompt(template_messages)).text == without_tools

    async def scenario():
        async with clients(bare(model_folder)) as c:
            counted = await c.anthropic.messages.count_tokens(model=BARE, messages=anthropic_history,
                                                              tools=[ANTHROPIC_WEATHER])
            answered = await c.anthropic.messages.create(model=BARE, messages=anthropic_history,
                                                         tools=[ANTHROPIC_WEATHER], max_tokens=3, extra_body=GREEDY)
            chat = await c.openai.chat.completions.create(model=BARE, messages=openai_history, tools=[WEATHER],
                                                          max_tokens=3, **GREEDY)
            plain = await c.openai.chat.completions.create(model=BARE, messages=openai_history, max_tokens=3, **GREEDY)
            return counted, answered, chat, plain

    counted, answered, chat, plain = asyncio.run(scenario())
    tokens = len(tokenizer.encode(with_tools, add_special_tokens=False))
    assert counted.input_tokens == chat.usage.prompt_tokens == tokens
    assert answered.usage.input_tokens + answered.usage.cache_read_input_tokens == tokens
    assert plain.usage.prompt_tokens == len(tokenizer.encode(without_tools, add_special_tokens=False))


# ---- the real default model --------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_named_call_on_the_default_model_validates_against_its_schema():
    schema = {"type": "object", "properties": {"city": {"type": "string"},
                                               "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
              "required": ["city", "unit"]}
    tool = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                             "parameters": schema}}
    config = ModelConfig(model_id="smollm2", model_path="default", context_length=2048)

    async def scenario():
        async with clients(config) as c:
            return await c.openai.chat.completions.create(
                model="smollm2", messages=USER, tools=[tool], max_tokens=100, **GREEDY,
                tool_choice={"type": "function", "function": {"name": "get_weather"}})

    response = asyncio.run(scenario())
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), schema)


def test_the_encoder_describes_tools_compactly_when_in_full_they_pass_the_budget(model_folder):
    tokenizer = load_tokenizer_only(model_folder)
    prompt = ChatPrompt(messages=USER, tools=[LONG_TOOL])
    full_block = len(tokenizer.encode(tools_block([LONG_TOOL], "auto", None)))
    roomy = PromptEncoder(tokenizer, tools_in_system_prompt=True, tools_token_budget=full_block).encode(prompt)
    tight = PromptEncoder(tokenizer, tools_in_system_prompt=True, tools_token_budget=full_block - 1).encode(prompt)
    assert "More guidance." in roomy.text and '"parameters": {"type": "object"' in roomy.text
    assert "More guidance." not in tight.text and '"command": "string, required"' in tight.text
    assert len(tight.token_ids) < len(roomy.token_ids) - 100
