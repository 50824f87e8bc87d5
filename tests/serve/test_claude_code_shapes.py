"""Claude Code's request shapes on /v1/messages and count_tokens (issue 26, point 2), one by one (no model):
each accepted with the meaning it has here, or refused naming the field."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from deployments.api.anthropic_convert import chat_prompt, messages_job
from deployments.api.anthropic_schemas import CountTokensRequest, MessagesRequest
from engine.errors import InvalidRequestError
from engine.sampling.guided import GuidedDecoding

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"name": "get_weather", "description": "Weather", "input_schema": SCHEMA}
HOUR = {"type": "ephemeral", "ttl": "1h"}
USER = [{"role": "user", "content": "Weather in Paris?"}]
PNG = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
# Anthropic's own tools, as their docs and Claude Code spell them.
ANTHROPIC_TOOLS = [
    {"type": "web_search_20250305", "name": "web_search", "max_uses": 5, "allowed_domains": ["example.com"]},
    {"type": "web_fetch_20250910", "name": "web_fetch", "max_uses": 3},
    {"type": "code_execution_20250825", "name": "code_execution"},
    {"type": "bash_20250124", "name": "bash"},
    {"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"},
    {"type": "tool_search_tool_regex_20251119", "name": "tool_search_tool_regex"},
    {"type": "mcp_toolset", "mcp_server_name": "docs", "cache_control": HOUR},
]


def body(**fields) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 64, "messages": USER, **fields})


def refused(**fields) -> InvalidRequestError:
    """The InvalidRequestError that parsing or converting the body raises."""
    with pytest.raises(InvalidRequestError) as caught:
        messages_job(body(**fields), "msg_1", "log")
    return caught.value


def invalid_locs(**fields) -> list[str]:
    with pytest.raises(ValidationError) as caught:
        body(**fields)
    return [".".join(str(p) for p in e["loc"]) for e in caught.value.errors()]


def tool_names(request: MessagesRequest) -> list[str] | None:
    tools = chat_prompt(request).tools
    return None if tools is None else [t["function"]["name"] for t in tools]


# ---- output_config: effort accepted, format = structured output ----------------------------------------------
def test_output_config_format_json_schema_is_structured_output():
    job = messages_job(body(output_config={"effort": "high", "format": {"type": "json_schema", "schema": SCHEMA}}),
                       "msg_1", "log")
    assert job.sampling.guided == GuidedDecoding("json_schema", json.dumps(SCHEMA))
    assert job.sampling.guided.param == "output_config.format"
    beta = messages_job(body(output_format={"type": "json_schema", "schema": SCHEMA}), "msg_1", "log")
    assert beta.sampling.guided == GuidedDecoding("json_schema", json.dumps(SCHEMA))
    assert beta.sampling.guided.param == "output_format"
    assert messages_job(body(output_config={"effort": "medium"}), "msg_1", "log").sampling.guided is None


def test_output_formats_we_cannot_honour_are_refused_by_name():
    assert invalid_locs(output_config={"format": {"type": "json_object"}})[0] == "output_config.format.type"
    assert invalid_locs(output_config={"format": {"type": "json_schema"}}) == ["output_config.format.schema"]
    assert invalid_locs(output_config={"effort": 3}) == ["output_config.effort"]
    fmt = {"type": "json_schema", "schema": SCHEMA}
    both = refused(output_config={"format": fmt}, output_format=fmt)
    assert both.param == "output_format" and "not both" in both.message
    forced = refused(output_config={"format": fmt}, tools=[TOOL], tool_choice={"type": "any"})
    assert forced.param == "output_config.format" and "forces a tool call" in forced.message


# ---- thinking, context_management, metadata ------------------------------------------------------------------
@pytest.mark.parametrize("thinking, kwargs", [
    ({"type": "enabled", "budget_tokens": 1024}, {"enable_thinking": True}),
    ({"type": "enabled", "budget_tokens": 31999, "display": "summarized"}, {"enable_thinking": True}),
    ({"type": "disabled"}, {"enable_thinking": False}),
    ({"type": "adaptive", "display": "omitted"}, {}),  # Claude Code 2.1's: the template's own default
])
def test_thinking_switches_the_template(thinking, kwargs):
    assert chat_prompt(body(thinking=thinking)).template_kwargs == kwargs


@pytest.mark.parametrize("thinking, loc", [
    ({"type": "enabled", "budget_tokens": 0}, "thinking.budget_tokens"),
    ({"type": "enabled", "budget_tokens": "many"}, "thinking.budget_tokens"),
    ({"type": "sometimes"}, "thinking.type"),
])
def test_bad_thinking_values_are_refused(thinking, loc):
    assert invalid_locs(thinking=thinking) == [loc]


def test_context_management_and_metadata_are_accepted_and_change_nothing():
    plain = chat_prompt(body())
    edits = {"edits": [{"type": "clear_thinking_20251015", "keep": "all"},
                       {"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 30000}}]}
    user_id = json.dumps({"device_id": "d" * 64, "account_uuid": "", "session_id": "s1"})  # Claude Code's
    shaped = body(context_management=edits, metadata={"user_id": user_id})
    assert chat_prompt(shaped) == plain
    assert shaped.model_extra == {}  # known fields, not counted as ignored ones
    assert invalid_locs(context_management={"edits": "all"}) == ["context_management.edits"]
    assert invalid_locs(context_management={"edits": [{"keep": "all"}]}) == ["context_management.edits.0.type"]


# ---- tool_choice ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("choice, expected", [
    ({"type": "auto"}, ("auto", None, True)),
    ({"type": "auto", "disable_parallel_tool_use": True}, ("auto", None, False)),
    ({"type": "any"}, ("required", None, True)),
    ({"type": "any", "disable_parallel_tool_use": True}, ("required", None, False)),
    ({"type": "tool", "name": "get_weather"}, ("function", "get_weather", True)),
    ({"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}, ("function", "get_weather", False)),
    ({"type": "none"}, ("none", None, True)),
])
def test_every_tool_choice(choice, expected):
    prompt = chat_prompt(body(tools=[TOOL], tool_choice=choice))
    assert (prompt.tool_choice, prompt.tool_name, prompt.parallel_tool_calls) == expected


def test_bad_tool_choices_are_refused_by_name():
    assert invalid_locs(tools=[TOOL], tool_choice={"type": "required"}) == ["tool_choice.type"]
    assert invalid_locs(tools=[TOOL], tool_choice={"type": "auto", "parallel": False}) == ["tool_choice.parallel"]
    assert refused(tools=[TOOL], tool_choice={"type": "tool", "name": "nope"}).param == "tool_choice.name"
    assert refused(tool_choice={"type": "any"}).param == "tool_choice"


# ---- cache_control with TTLs, wherever blocks carry it -----------------------------------------------------------
def test_cache_control_with_ttls_is_accepted_on_every_block():
    doc = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "Notes."},
           "cache_control": HOUR}
    request = body(
        system=[{"type": "text", "text": "Be brief.", "cache_control": HOUR}],
        tools=[{**TOOL, "cache_control": {"type": "ephemeral", "ttl": "5m"}}],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "Weather?", "cache_control": {"type": "ephemeral"}},
                                         doc]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Call it.", "signature": "s", "cache_control": HOUR},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"},
                 "cache_control": HOUR}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "cache_control": HOUR,
                                          "content": [{"type": "text", "text": "18 C", "cache_control": HOUR}]}]},
        ],
    )
    messages = chat_prompt(request).messages
    assert messages[0] == {"role": "system", "content": "Be brief."}
    assert messages[1] == {"role": "user", "content": "Weather?\n\nNotes."}
    assert messages[-1] == {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C"}


@pytest.mark.parametrize("cache_control, field", [({"type": "ephemeral", "ttl": "2h"}, "ttl"),
                                                   ({"type": "persistent"}, "type")])
def test_bad_cache_control_is_refused(cache_control, field):
    assert invalid_locs(tools=[{**TOOL, "cache_control": cache_control}]) == [f"tools.0.cache_control.{field}"]
    # (pydantic names the union's member in the path: system.list[TextBlock].0...)
    in_system = invalid_locs(system=[{"type": "text", "text": "x", "cache_control": cache_control}])
    assert in_system[-1].endswith(f".0.cache_control.{field}")


# ---- Anthropic's own tools: accepted, not offered; a request that depends on one is refused ----------------------
def test_anthropic_tools_are_accepted_and_not_offered():
    request = body(tools=[*ANTHROPIC_TOOLS, TOOL], tool_choice={"type": "auto"})
    assert tool_names(request) == ["get_weather"]
    assert tool_names(body(tools=ANTHROPIC_TOOLS)) is None
    counted = CountTokensRequest.model_validate({"model": "m", "messages": USER, "tools": ANTHROPIC_TOOLS})
    assert chat_prompt(counted).tools is None


def test_a_tool_choice_naming_an_anthropic_tool_is_refused():
    error = refused(tools=[*ANTHROPIC_TOOLS, TOOL], tool_choice={"type": "tool", "name": "web_search"})
    assert error.param == "tool_choice.name"
    assert "web_search_20250305" in error.message and "cannot run" in error.message
    only_anthropic = refused(tools=ANTHROPIC_TOOLS, tool_choice={"type": "any"})
    assert only_anthropic.param == "tool_choice"


@pytest.mark.parametrize("tool, param", [
    ({"type": "function", "name": "f", "input_schema": SCHEMA}, "tools.0.type"),  # OpenAI's spelling
    ({"type": "web_search", "name": "web_search"}, "tools.0.type"),  # no version date
])
def test_unknown_tool_types_are_refused(tool, param):
    assert invalid_locs(tools=[tool]) == [param]


@pytest.mark.parametrize("tool, param", [
    ({"name": "f"}, "tools.0.input_schema"),
    ({"type": "custom", "name": "f"}, "tools.0.input_schema"),
    ({"input_schema": SCHEMA}, "tools.0.name"),
])
def test_custom_tools_need_a_name_and_a_schema(tool, param):
    with pytest.raises(InvalidRequestError) as caught:
        body(tools=[tool])
    assert caught.value.param == param


# ---- deferred tools (Claude Code's ToolSearch) --------------------------------------------------------------------
def test_deferred_tools_are_offered_once_a_tool_reference_loads_them():
    deferred = {**TOOL, "name": "mcp__docs__search", "defer_loading": True}
    search = {"name": "ToolSearch", "input_schema": {"type": "object", "properties": {"query": {"type": "string"}}}}
    tools = [search, deferred]
    assert tool_names(body(tools=tools)) == ["ToolSearch"]
    assert tool_names(body(tools=tools, tool_choice={"type": "tool", "name": "mcp__docs__search"})) == [
        "ToolSearch", "mcp__docs__search"]
    loaded = body(tools=tools, messages=[
        *USER,
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "ToolSearch",
                                           "input": {"query": "docs"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [
            {"type": "tool_reference", "tool_name": "mcp__docs__search"}]}]},
    ])
    assert tool_names(loaded) == ["ToolSearch", "mcp__docs__search"]
    assert chat_prompt(loaded).messages[-1] == {
        "role": "tool", "tool_call_id": "toolu_1", "content": "Tool 'mcp__docs__search' loaded."}


# ---- images (issue 27: converted here; a text-only model refuses them on the model side) and documents ----------
def test_images_become_parts_in_place_in_user_turns_and_tool_results():
    in_result = [
        *USER,
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": "A map:"}, PNG]}]},
    ]
    prompt = messages_job(body(tools=[TOOL], messages=in_result), "msg_1", "log").prompt
    assert prompt.messages[-1] == {"role": "tool", "tool_call_id": "toolu_1",
                                   "content": [{"type": "text", "text": "A map:"}, {"type": "image"}]}
    assert [(i.param, i.media_type, i.data) for i in prompt.images] == [
        ("messages.2.content.0.content.1", "image/png", b"\x89PNG\r\n\x1a\n")]
    counted = chat_prompt(CountTokensRequest.model_validate({"model": "m", "messages": in_result}))
    assert counted.messages == prompt.messages and [i.param for i in counted.images] == [prompt.images[0].param]
    in_user = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, PNG]}]
    assert chat_prompt(body(messages=in_user)).images[0].param == "messages.0.content.1"
    text_only = [*in_result[:2], {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18 C"}]}]}]
    text_prompt = chat_prompt(body(tools=[TOOL], messages=text_only))
    assert text_prompt.messages[-1]["content"] == "18 C" and text_prompt.images == []
    assert refused(messages=[*USER, {"role": "assistant", "content": [PNG]}]).param == "messages.1.content.0"


def test_text_documents_are_read_and_other_documents_refused():
    text_doc = {"type": "document", "title": "Notes", "context": "From the user.",
                "source": {"type": "text", "media_type": "text/plain", "data": "Paris is sunny."}}
    content_doc = {"type": "document", "source": {"type": "content", "content": [
        {"type": "text", "text": "Part one."}, {"type": "text", "text": "Part two."}]}}
    request = body(messages=[{"role": "user", "content": [text_doc, content_doc, {"type": "text", "text": "Sum up."}]}])
    assert chat_prompt(request).messages == [{"role": "user", "content": (
        "Notes\n\nFrom the user.\n\nParis is sunny.\n\nPart one.\n\nPart two.\n\nSum up.")}]
    pdf = {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0="}}
    error = refused(messages=[{"role": "user", "content": [{"type": "text", "text": "Read:"}, pdf]}])
    assert error.param == "messages.0.content.1.source" and "'base64' source" in error.message
    url = {"type": "document", "source": {"type": "url", "url": "https://example.com/a.pdf"}}
    assert refused(messages=[{"role": "user", "content": [url]}]).param == "messages.0.content.0.source"


def test_system_as_blocks():
    request = body(system=[{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.332;"},
                           {"type": "text", "text": "You are an agent.", "cache_control": HOUR}])
    assert chat_prompt(request).messages[0] == {
        "role": "system", "content": "x-anthropic-billing-header: cc_version=2.1.332;\n\nYou are an agent."}
    assert invalid_locs(system=[{"type": "image", "source": {}}]) != []
