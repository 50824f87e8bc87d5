"""The generic tool format, for models whose chat template has no tool format of ours (tool_call_parser "generic").

The tools are described in the system prompt, and calls are written in the Hermes convention
(`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`): the JSON convention small instruct models have seen
most, the one Qwen's and Hermes' templates teach, read back by the HERMES parser and enforced by the same
forced-call regex. Past calls and tool results are rendered as text in the same convention, since templates
without tools drop `tool_calls` and know no `tool` role.
"""

from __future__ import annotations

import json
import re
from typing import Any

from deployments.model_calls import ToolChoiceMode

Content = str | list[dict[str, Any]]  # a message's content: text, or parts with images

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
RESULT_START, RESULT_END = "<tool_response>", "</tool_response>"

_INTRO = (
    "# Tools\n\n"
    "You can call functions to help with the user's request. Each function is described by one JSON object "
    "inside <tools></tools>: its name, what it does, and the JSON schema of its arguments.\n<tools>\n"
)
_COMPACT_INTRO = (
    "# Tools\n\n"
    "You can call functions to help with the user's request. Each function is described by one JSON object "
    "inside <tools></tools>: its name, what it does, and its arguments with their types (those marked "
    "\"required\" must be given).\n<tools>\n"
)
# A compact description keeps this much of a function's description (its first sentence, at most).
COMPACT_DESCRIPTION_CHARS = 200
_WORD = re.compile(r"\S+")
_HOW_TO_CALL = (
    "\n</tools>\n\n"
    "To call a function, reply with a JSON object holding its name and arguments inside <tool_call></tool_call> "
    "tags:\n<tool_call>\n{\"name\": \"function_name\", \"arguments\": {\"argument_name\": \"value\"}}\n</tool_call>\n"
    "Write one <tool_call> block per call. Each call's result comes back inside <tool_response></tool_response> tags."
)


def tools_block(
    tools: list[dict[str, Any]], tool_choice: ToolChoiceMode, tool_name: str | None, compact: bool = False
) -> str:
    """The system-prompt text that lists `tools` (OpenAI-style definitions) and says how to call them. `compact`:
    each function by its name, its description's first sentence and its parameters' names and types."""
    describe = _compact if compact else _in_full
    lines = [json.dumps(describe(tool["function"]), ensure_ascii=False) for tool in tools]
    block = (_COMPACT_INTRO if compact else _INTRO) + "\n".join(lines) + _HOW_TO_CALL
    if tool_choice == "function":
        block += f"\nAnswer by calling the function {tool_name}."
    elif tool_choice == "required":
        block += "\nAnswer with a function call."
    return block


def _in_full(function: dict[str, Any]) -> dict[str, Any]:
    described = {"name": function["name"]}
    if function.get("description"):
        described["description"] = function["description"]
    described["parameters"] = function.get("parameters") or {"type": "object", "properties": {}}
    return described


def _compact(function: dict[str, Any]) -> dict[str, Any]:
    described = {"name": function["name"]}
    if function.get("description"):
        described["description"] = _first_sentence(function["description"])
    parameters = function.get("parameters") or {}
    required = set(parameters.get("required") or ())
    described["arguments"] = {
        key: _type_name(spec) + (", required" if key in required else "")
        for key, spec in (parameters.get("properties") or {}).items()
    }
    return described


def _first_sentence(text: str) -> str:
    # Only the start can be kept, so only the start is read: a description of megabytes took seconds here.
    text = " ".join(_leading_words(text, COMPACT_DESCRIPTION_CHARS + 1))[:COMPACT_DESCRIPTION_CHARS + 1]
    end = next((i + 1 for i, c in enumerate(text) if c in ".!?" and (i + 1 == len(text) or text[i + 1] == " ")),
               len(text))
    text = text[:end]
    return text if len(text) <= COMPACT_DESCRIPTION_CHARS else text[:COMPACT_DESCRIPTION_CHARS - 3] + "..."


def _leading_words(text: str, chars: int) -> list[str]:
    """The first words of `text` (split at whitespace) that, joined by single spaces, take at least `chars`."""
    words: list[str] = []
    length = -1
    for match in _WORD.finditer(text):
        words.append(match.group())
        length += len(words[-1]) + 1
        if length >= chars:
            break
    return words


def _type_name(spec: Any) -> str:
    """A JSON schema's type in a word or two: "string", "array of string", "one of: a, b", "any"."""
    if not isinstance(spec, dict):
        return "any"
    if isinstance(spec.get("enum"), list):
        return "one of: " + ", ".join(json.dumps(v, ensure_ascii=False) for v in spec["enum"][:8])
    kind = spec.get("type")
    if isinstance(kind, list):
        return " or ".join(str(k) for k in kind)
    if kind == "array":
        return "array of " + _type_name(spec.get("items"))
    return kind if isinstance(kind, str) else "any"


def call_text(call: dict[str, Any]) -> str:
    """One past call (an OpenAI-style `tool_calls` entry) as the model would have written it."""
    function = call.get("function") or {}
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):  # arguments as JSON text (or invalid text, kept as written)
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    body = json.dumps({"name": function.get("name", ""), "arguments": arguments}, ensure_ascii=False)
    return f"{CALL_START}\n{body}\n{CALL_END}"


def history_as_text(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant tool calls become <tool_call> blocks in its content; tool results become user turns with
    <tool_response> blocks (adjacent results and the user text next to them share one turn, for templates that
    insist on alternating roles)."""
    out: list[dict[str, Any]] = []
    last_was_result = False
    for message in messages:
        role = message.get("role")
        if role == "assistant" and message.get("tool_calls"):
            parts = [message["content"]] if message.get("content") else []
            rendered = {k: v for k, v in message.items() if k != "tool_calls"}
            rendered["content"] = "\n".join(parts + [call_text(call) for call in message["tool_calls"]])
            out.append(rendered)
            last_was_result = False
        elif role == "tool":
            text = joined_content(joined_content(RESULT_START, message.get("content") or ""), RESULT_END)
            _add_user_text(out, text, merge=bool(out) and out[-1]["role"] == "user" and last_was_result)
            last_was_result = True
        elif role == "user" and last_was_result:
            _add_user_text(out, message.get("content") or "", merge=True)
            last_was_result = False
        else:
            out.append(message)
            last_was_result = False
    return out


def _add_user_text(out: list[dict[str, Any]], text: Content, merge: bool) -> None:
    if merge:
        out[-1] = {**out[-1], "content": joined_content(out[-1]["content"], text)}
    else:
        out.append({"role": "user", "content": text})


def joined_content(before: Content, after: Content, separator: str = "\n") -> Content:
    """Two message contents as one: text stays text; with images (lists of parts, model_calls.ChatPrompt), parts."""
    if isinstance(before, str) and isinstance(after, str):
        return f"{before}{separator}{after}" if before else after
    parts = [*_parts(before), *_parts(after)]
    if _parts(before) and _parts(after):
        parts.insert(len(_parts(before)), {"type": "text", "text": separator})
    return parts


def _parts(content: Content) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content else []
    return list(content)


def with_system_block(messages: list[dict[str, Any]], block: str) -> list[dict[str, Any]]:
    """The tools block after the first system message's text, or as a system message of its own."""
    if messages and messages[0].get("role") == "system":
        system = messages[0].get("content") or ""
        return [{**messages[0], "content": joined_content(system, block, "\n\n")}, *messages[1:]]
    return [{"role": "system", "content": block}, *messages]


def with_user_block(messages: list[dict[str, Any]], block: str) -> list[dict[str, Any]]:
    """The tools block at the start of the first user message (for templates that refuse a system turn)."""
    for index, message in enumerate(messages):
        if message.get("role") == "user":
            merged = {**message, "content": joined_content(block, message.get("content") or "", "\n\n")}
            return [*messages[:index], merged, *messages[index + 1:]]
    return [{"role": "user", "content": block}, *messages]
