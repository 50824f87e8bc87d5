"""The generic tool format's prompt text: the tools block, and a tool loop's history as plain turns."""

from __future__ import annotations

from deployments.chat.generic_tools import (
    history_as_text,
    tools_block,
    with_system_block,
    with_user_block,
)

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
BARE_TOOL = {"type": "function", "function": {"name": "now"}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}


def test_the_tools_block_lists_each_function_and_how_to_call():
    block = tools_block([TOOL, BARE_TOOL], "auto", None)
    assert block == (
        "# Tools\n\nYou can call functions to help with the user's request. Each function is described by one JSON "
        "object inside <tools></tools>: its name, what it does, and the JSON schema of its arguments.\n<tools>\n"
        '{"name": "get_weather", "description": "Current weather", "parameters": {"type": "object", "properties": '
        '{"city": {"type": "string"}}}}\n'
        '{"name": "now", "parameters": {"type": "object", "properties": {}}}\n</tools>\n\n'
        "To call a function, reply with a JSON object holding its name and arguments inside <tool_call></tool_call> "
        'tags:\n<tool_call>\n{"name": "function_name", "arguments": {"argument_name": "value"}}\n</tool_call>\n'
        "Write one <tool_call> block per call. Each call's result comes back inside <tool_response></tool_response> "
        "tags.")
    assert tools_block([TOOL], "required", None) == tools_block([TOOL], "auto", None) + "\nAnswer with a function call."
    assert tools_block([TOOL], "function", "get_weather").endswith("\nAnswer by calling the function get_weather.")


def test_history_turns_calls_and_results_into_text():
    messages = [
        {"role": "user", "content": "Weather in Paris and Tokyo?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "two calls",
         "tool_calls": [CALL, {**CALL, "function": {"name": "get_weather", "arguments": '{"city": "Tokyo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "25 C"},
        {"role": "user", "content": "And Berlin?"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "not json"}}]},
        {"role": "tool", "content": "ok"},
        {"role": "assistant", "content": "Done."},
    ]
    assert history_as_text(messages) == [
        {"role": "user", "content": "Weather in Paris and Tokyo?"},
        {"role": "assistant", "reasoning_content": "two calls", "content":
            'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tokyo"}}\n</tool_call>'},
        # Adjacent results and the user text after them share one user turn (roles keep alternating).
        {"role": "user", "content": "<tool_response>\n18 C\n</tool_response>\n<tool_response>\n25 C\n</tool_response>"
                                    "\nAnd Berlin?"},
        {"role": "assistant", "content": '<tool_call>\n{"name": "f", "arguments": "not json"}\n</tool_call>'},
        {"role": "user", "content": "<tool_response>\nok\n</tool_response>"},
        {"role": "assistant", "content": "Done."},
    ]
    plain = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert history_as_text(plain) == plain  # a chat without tools is left as it is


def test_the_block_goes_after_the_system_text_or_before_the_first_user_text():
    user = {"role": "user", "content": "hi"}
    assert with_system_block([{"role": "system", "content": "Be brief."}, user], "TOOLS") == [
        {"role": "system", "content": "Be brief.\n\nTOOLS"}, user]
    assert with_system_block([user], "TOOLS") == [{"role": "system", "content": "TOOLS"}, user]
    assert with_user_block([user], "TOOLS") == [{"role": "user", "content": "TOOLS\n\nhi"}]


LONG_TOOL = {"type": "function", "function": {
    "name": "Bash",
    "description": "Executes a bash command and returns its output.\n\nThe working directory persists between "
                   "commands. " + "More guidance. " * 50,
    "parameters": {"type": "object", "required": ["command"], "properties": {
        "command": {"type": "string", "description": "The command to run"},
        "timeout": {"type": "number"},
        "mode": {"enum": ["fast", "safe"]},
        "paths": {"type": "array", "items": {"type": "string"}},
        "extra": {"description": "no type"},
    }}}}


def test_a_compact_block_gives_each_function_its_first_sentence_and_typed_argument_names():
    block = tools_block([LONG_TOOL, BARE_TOOL], "auto", None, compact=True)
    assert block == (
        "# Tools\n\nYou can call functions to help with the user's request. Each function is described by one JSON "
        "object inside <tools></tools>: its name, what it does, and its arguments with their types (those marked "
        '"required" must be given).\n<tools>\n'
        '{"name": "Bash", "description": "Executes a bash command and returns its output.", "arguments": {"command": '
        '"string, required", "timeout": "number", "mode": "one of: \\"fast\\", \\"safe\\"", "paths": "array of string", '
        '"extra": "any"}}\n'
        '{"name": "now", "arguments": {}}\n</tools>\n\n'
        "To call a function, reply with a JSON object holding its name and arguments inside <tool_call></tool_call> "
        'tags:\n<tool_call>\n{"name": "function_name", "arguments": {"argument_name": "value"}}\n</tool_call>\n'
        "Write one <tool_call> block per call. Each call's result comes back inside <tool_response></tool_response> "
        "tags.")
    sentence_less = {"type": "function", "function": {"name": "f", "description": "x" * 500}}
    assert '"description": "' + "x" * 197 + '..."' in tools_block([sentence_less], "auto", None, compact=True)

