"""Model outputs as each family writes them (markup as in their chat templates and model cards),
with the events a parser must turn them into. Text is what our detokenizer streams."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from deployments.output_deltas import ContentDelta, ParsedEvent, ReasoningDelta, ToolCallDelta
from deployments.chat.parsers.selection import ParserNames

WEATHER_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                         "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}}},
]
FILE_TOOLS = [
    {"type": "function", "function": {"name": "read_file", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}, "limit": {"type": "integer"},
                                         "follow": {"type": "boolean"}}, "required": ["path"]}}},
    {"type": "function", "function": {"name": "run_shell", "parameters": {
        "type": "object", "properties": {"command": {"type": "string"}, "env": {"type": "object"}}}}},
]


def call(index: int, name: str, arguments: dict[str, Any] | str) -> ToolCallDelta:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCallDelta(index, text, f"call_{index}", name)


def merge_events(events: list[ParsedEvent]) -> list[ParsedEvent]:
    """Adjacent deltas of the same kind (and the same tool call) joined: the canonical form recordings are kept in
    (a parser may split its output anywhere)."""
    merged: list[ParsedEvent] = []
    for event in events:
        last = merged[-1] if merged else None
        if isinstance(event, ContentDelta) and isinstance(last, ContentDelta):
            merged[-1] = ContentDelta(last.text + event.text)
        elif isinstance(event, ReasoningDelta) and isinstance(last, ReasoningDelta):
            merged[-1] = ReasoningDelta(last.text + event.text)
        elif isinstance(event, ToolCallDelta) and isinstance(last, ToolCallDelta) and last.index == event.index:
            merged[-1] = last.joined(event)
        elif not (isinstance(event, (ContentDelta, ReasoningDelta)) and not event.text):
            merged.append(event)
    return merged


@dataclass
class Recording:
    name: str
    names: ParserNames
    output: str
    expected: list[ParsedEvent]
    tools: list[dict[str, Any]] | None = field(default_factory=lambda: WEATHER_TOOLS)
    prompt_text: str = "<|im_start|>assistant\n"
    parallel_tool_calls: bool = True


QWEN3 = ParserNames("qwen3", "qwen3")
RECORDINGS = [
    Recording(
        "qwen3: thinking, text, then two parallel calls", QWEN3,
        "<think>\nThe user wants the weather in Paris and Berlin. I should call get_weather twice.\n</think>\n\n"
        "I'll check both cities.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n<tool_call>\n'
        '{"name": "get_weather", "arguments": {"city": "Berlin", "unit": "celsius"}}\n</tool_call>',
        [ReasoningDelta("The user wants the weather in Paris and Berlin. I should call get_weather twice."),
         ContentDelta("I'll check both cities."),
         call(0, "get_weather", {"city": "Paris", "unit": "celsius"}),
         call(1, "get_weather", {"city": "Berlin", "unit": "celsius"})],
    ),
    Recording(
        "qwen3 thinking model: the prompt opened <think>", QWEN3,
        "Okay, 2 + 2 = 4. Nothing to look up.\n</think>\n\nThe answer is **4** — über-simple. 🙂",
        [ReasoningDelta("Okay, 2 + 2 = 4. Nothing to look up."), ContentDelta("The answer is **4** — über-simple. 🙂")],
        prompt_text="<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n",
    ),
    Recording(
        "qwen3: thinking off, plain answer that mentions tags", QWEN3,
        "Use <tool_call> tags like <this>; a lone < or </think is fine.",
        [ContentDelta("Use <tool_call> tags like <this>; a lone < or </think is fine.")],
        tools=None,
        prompt_text="<|im_start|>assistant\n<think>\n\n</think>\n\n",
    ),
    Recording(
        "qwen3: malformed JSON (wrapper brace missing) and an unreadable call", QWEN3,
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}\n</tool_call>\n'
        "<tool_call>\nnot json at all\n</tool_call>",
        [call(0, "get_weather", {"city": "Oslo"}), ContentDelta("not json at all")],
    ),
    Recording(
        "qwen3: parallel_tool_calls false keeps the first call", QWEN3,
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n</tool_call>',
        [call(0, "get_weather", {"city": "Rome"})],
        parallel_tool_calls=False,
    ),
    Recording(
        "qwen3: output cut inside a call (max_tokens)", QWEN3,
        'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Ki',
        [ContentDelta("Sure."), call(0, "get_weather", '{"city": "Ki')],
    ),
    Recording(
        "qwen3_coder: text then two calls with typed parameters", ParserNames("qwen3_coder", None),
        "Let me look at the file first.\n<tool_call>\n<function=read_file>\n<parameter=path>\nsrc/main.py\n"
        "</parameter>\n<parameter=limit>\n50\n</parameter>\n<parameter=follow>\ntrue\n</parameter>\n</function>\n"
        "</tool_call>\n<tool_call>\n<function=run_shell>\n<parameter=command>\nls -la | grep '<x>'\n</parameter>\n"
        '<parameter=env>\n{"LANG": "C"}\n</parameter>\n</function>\n</tool_call>',
        [ContentDelta("Let me look at the file first."),
         call(0, "read_file", {"path": "src/main.py", "limit": 50, "follow": True}),
         call(1, "run_shell", {"command": "ls -la | grep '<x>'", "env": {"LANG": "C"}})],
        tools=FILE_TOOLS,
    ),
    Recording(
        "glm4_moe: thinking, then a call with key/value pairs", ParserNames("glm4_moe", "glm4_moe"),
        "<think>用户想知道北京的天气。</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
        "<arg_value>北京</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
        [ReasoningDelta("用户想知道北京的天气。"), call(0, "get_weather", {"city": "北京", "days": 3})],
    ),
    Recording(
        "minimax_m2: thinking, then one block holding two invokes", ParserNames("minimax_m2", "minimax_m2"),
        "<think>\nTwo files are needed.\n</think>\n\n<minimax:tool_call>\n<invoke name=\"read_file\">\n"
        "<parameter name=\"path\">a.txt</parameter>\n<parameter name=\"limit\">10</parameter>\n</invoke>\n"
        "<invoke name=\"read_file\">\n<parameter name=\"path\">b.txt</parameter>\n</invoke>\n</minimax:tool_call>",
        [ReasoningDelta("Two files are needed."), call(0, "read_file", {"path": "a.txt", "limit": 10}),
         call(1, "read_file", {"path": "b.txt"})],
        tools=FILE_TOOLS,
    ),
    Recording(
        "harmony: analysis then a function call (<|call|> is a stop token)", ParserNames("harmony", "harmony"),
        "<|channel|>analysis<|message|>User asks for Tokyo's weather. Use the tool.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"city":"Tokyo","unit":"celsius"}',
        [ReasoningDelta("User asks for Tokyo's weather. Use the tool."),
         call(0, "get_weather", {"city": "Tokyo", "unit": "celsius"})],
    ),
    Recording(
        "harmony: analysis, preamble, final answer", ParserNames("harmony", "harmony"),
        "<|channel|>analysis<|message|>Simple greeting; answer warmly.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Hello! How can I help <you> today?",
        [ReasoningDelta("Simple greeting; answer warmly."), ContentDelta("Hello! How can I help <you> today?")],
        tools=None,
    ),
]
