"""Regexes that force a tool call (`tool_choice: required` or a named function) in a family's markup.

The JSON parts come from the engine's schema converter (outlines-core underneath); the engine's structured-output masks
then let even a weak model write only a valid call. One call per forced request.
"""

from __future__ import annotations

from typing import Any

from engine.errors import InvalidRequestError
from deployments.chat.parsers.selection import HARMONY, TOOL_FORMATS, ParserNames
from deployments.chat.parsers.tool_formats import GLM4_MOE, HERMES, MINIMAX_M2, QWEN3_CODER
from engine.sampling.guided_regex import json_schema_regex

_META = set("\\.+*?()|[]{}^$")
# Text values of XML-style parameters: anything but the start of the next tag.
_TEXT_VALUE = r"[^<]*"


def literal(text: str) -> str:
    """`text` as a regex matching exactly it (escapes only what the regex syntax needs)."""
    return "".join("\\" + c if c in _META else {"\n": "\\n", "\t": "\\t"}.get(c, c) for c in text)


def _json_regex(schema: dict[str, Any]) -> str:
    # The engine's converter, not outlines-core's directly: it enforces numeric bounds, refuses what a
    # regex cannot enforce, and keeps free-form parameters ({"type": "object"}) fast to compile.
    try:
        return json_schema_regex(schema, param="tools")
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"A tool's parameters schema cannot be enforced: {exc.message}", param="tools") from None


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    parameters = tool["function"].get("parameters")
    return parameters if isinstance(parameters, dict) and parameters else {"type": "object"}


def _hermes_call(tool: dict[str, Any]) -> str:
    name = tool["function"]["name"]
    schema = {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": _parameters(tool)},
        "required": ["name", "arguments"],
    }
    return literal("<tool_call>\n") + _json_regex(schema) + literal("\n</tool_call>")


def _value_regex(spec: Any) -> str:
    if not isinstance(spec, dict) or spec.get("type") in (None, "string"):
        return _TEXT_VALUE
    return _json_regex(spec)


def _xml_params(tool: dict[str, Any], param: str) -> str:
    """Each declared parameter in order; required ones must appear. `param` formats one parameter
    from its literal name and value regex."""
    parameters = _parameters(tool)
    required = set(parameters.get("required") or ())
    parts = []
    for key, spec in (parameters.get("properties") or {}).items():
        one = param.format(key=literal(key), value=_value_regex(spec))
        parts.append(one if key in required else f"({one})?")
    return "".join(parts)


def _coder_call(tool: dict[str, Any]) -> str:
    params = _xml_params(tool, literal("<parameter=") + "{key}" + literal(">\n") + "{value}"
                         + literal("\n</parameter>\n"))
    name = literal(tool["function"]["name"])
    return literal("<tool_call>\n<function=") + name + literal(">\n") + params + literal("</function>\n</tool_call>")


def _glm_call(tool: dict[str, Any]) -> str:
    params = _xml_params(tool, literal("<arg_key>") + "{key}" + literal("</arg_key>\n<arg_value>") + "{value}"
                         + literal("</arg_value>\n"))
    return literal("<tool_call>") + literal(tool["function"]["name"]) + literal("\n") + params + literal("</tool_call>")


def _minimax_call(tool: dict[str, Any]) -> str:
    params = _xml_params(tool, literal('<parameter name="') + "{key}" + literal('">') + "{value}"
                         + literal("</parameter>\n"))
    head = literal('<minimax:tool_call>\n<invoke name="') + literal(tool["function"]["name"]) + literal('">\n')
    return head + params + literal("</invoke>\n</minimax:tool_call>")


def _harmony_call(tool: dict[str, Any]) -> str:
    head = f"<|channel|>commentary to=functions.{tool['function']['name']} <|constrain|>json<|message|>"
    return literal(head) + _json_regex(_parameters(tool))


_BUILDERS = {HERMES.name: _hermes_call, QWEN3_CODER.name: _coder_call, GLM4_MOE.name: _glm_call,
             MINIMAX_M2.name: _minimax_call}


def forced_call_regex(names: ParserNames, tools: list[dict[str, Any]], function_name: str | None) -> str:
    """A regex for exactly one call of `function_name` (or of any of `tools` when None)."""
    if names.tool is None:
        raise InvalidRequestError(
            "This model has no tool-call format (set tool_call_parser when loading it), so tool_choice "
            "'required' or a named function cannot be enforced",
            param="tool_choice",
        )
    chosen = [t for t in tools if function_name is None or t["function"]["name"] == function_name]
    if not chosen:
        raise InvalidRequestError(f"tool_choice names '{function_name}', which is not in 'tools'", param="tool_choice")
    build = _harmony_call if names.tool == HARMONY else _BUILDERS[TOOL_FORMATS[names.tool].name]
    alternatives = [build(tool) for tool in chosen]
    return alternatives[0] if len(alternatives) == 1 else "(" + "|".join(alternatives) + ")"
