"""How each model family writes a tool call, and how to read one complete call back.

A format names the markers around a call block and parses a block's inner text into calls.
Argument values written as text (XML-style formats) are typed by the tool's JSON schema.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of the arguments object (as the model wrote it when it is not JSON)
    unfinished: bool = False  # the output was cut inside it: `arguments` is what was written so far


class MalformedCall(ValueError):
    """The block's text is not a call this format can read."""


ParamTypes = dict[str, dict[str, str]]  # function name -> parameter name -> JSON schema type
BlockParser = Callable[[str, ParamTypes], list[ParsedCall]]  # a block's inner text -> its calls


@dataclass(frozen=True)
class ToolFormat:
    name: str
    start: str
    end: str
    parse_block: BlockParser
    parse_unfinished: BlockParser  # a block the output was cut inside


def param_types(tools: list[dict[str, Any]] | None) -> ParamTypes:
    """OpenAI-style tool definitions -> each function's parameter types (for text-valued formats)."""
    types: ParamTypes = {}
    for tool in tools or []:
        function = tool.get("function") or {}
        properties = (function.get("parameters") or {}).get("properties") or {}
        types[function.get("name", "")] = {
            key: spec.get("type", "string") if isinstance(spec, dict) and isinstance(spec.get("type"), str) else "string"
            for key, spec in properties.items()
        }
    return types


def typed_value(raw: str, schema_type: str | None) -> Any:
    """A parameter's text as the JSON value its schema asks for; text when it does not parse."""
    if schema_type in (None, "string"):
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        lowered = raw.strip().lower()
        if schema_type == "boolean" and lowered in ("true", "false"):
            return lowered == "true"
        return raw


def _dump(arguments: dict[str, Any]) -> str:
    return json.dumps(arguments, ensure_ascii=False)


# ---- Hermes / Qwen3: <tool_call>{"name": ..., "arguments": {...}}</tool_call> -------------------
_HERMES_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)+)"')
_HERMES_ARGS = re.compile(r'"(?:arguments|parameters)"\s*:\s*', re.DOTALL)


def parse_hermes(body: str, types: ParamTypes) -> list[ParsedCall]:
    try:
        data = json.loads(body)
    except ValueError:
        return [_salvage_hermes(body)]
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        raise MalformedCall("a tool call object needs a string 'name'")
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):  # some models double-encode
        return [ParsedCall(data["name"], arguments)]
    return [ParsedCall(data["name"], _dump(arguments))]


def _salvage_hermes(body: str) -> ParsedCall:
    """Invalid JSON: keep the call if its name is readable; its arguments go out as written."""
    name = _HERMES_NAME.search(body)
    if name is None:
        raise MalformedCall("no function name in the tool call")
    found = _HERMES_ARGS.search(body)
    if found is None:
        return ParsedCall(json.loads(f'"{name.group(1)}"'), "{}")
    rest = body[found.end():]
    try:  # the arguments object itself may be whole (e.g. only the wrapper's brace is missing)
        arguments, _ = json.JSONDecoder().raw_decode(rest)
        return ParsedCall(json.loads(f'"{name.group(1)}"'), _dump(arguments))
    except ValueError:
        return ParsedCall(json.loads(f'"{name.group(1)}"'), rest.rstrip().removesuffix("}").rstrip())


def parse_hermes_unfinished(body: str, types: ParamTypes) -> list[ParsedCall]:
    """A call cut short: its name, and its arguments' text exactly as far as the model wrote it."""
    try:
        json.loads(body)
    except ValueError:
        pass
    else:  # whole after all: only the end marker is missing
        return parse_hermes(body, types)
    name = _HERMES_NAME.search(body)
    if name is None:
        raise MalformedCall("cut before the function name was written")
    found = _HERMES_ARGS.search(body, name.end()) or _HERMES_ARGS.search(body)
    return [ParsedCall(json.loads(f'"{name.group(1)}"'), body[found.end():] if found else "", unfinished=True)]


def _last_call_unfinished(parse: BlockParser) -> BlockParser:
    """For the XML formats, whose parsers already read an open parameter as far as it goes: the last call of a
    cut block is the unfinished one."""
    def parse_unfinished(body: str, types: ParamTypes) -> list[ParsedCall]:
        calls = parse(body, types)
        return calls[:-1] + [dataclasses.replace(calls[-1], unfinished=True)]
    return parse_unfinished


# ---- Qwen3-Coder: <tool_call><function=NAME><parameter=KEY>value</parameter></function></tool_call>
_CODER_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.DOTALL)
_CODER_PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)


def _strip_one_newline(value: str) -> str:
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def parse_qwen3_coder(body: str, types: ParamTypes) -> list[ParsedCall]:
    calls = []
    for function in _CODER_FUNCTION.finditer(body):
        name = function.group(1).strip()
        schema = types.get(name, {})
        arguments = {
            key.strip(): typed_value(_strip_one_newline(value), schema.get(key.strip()))
            for key, value in _CODER_PARAM.findall(function.group(2))
        }
        calls.append(ParsedCall(name, _dump(arguments)))
    if not calls:
        raise MalformedCall("no <function=...> in the tool call")
    return calls


# ---- GLM-4.5 / 4.6: <tool_call>NAME<arg_key>k</arg_key><arg_value>v</arg_value></tool_call> ---------
_GLM_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)(?:</arg_value>|$)", re.DOTALL)


def parse_glm4_moe(body: str, types: ParamTypes) -> list[ParsedCall]:
    name = body.split("<arg_key>", 1)[0].strip()
    if not name or "<" in name:
        raise MalformedCall("no function name in the tool call")
    schema = types.get(name, {})
    arguments = {key.strip(): typed_value(value, schema.get(key.strip())) for key, value in _GLM_PAIR.findall(body)}
    return [ParsedCall(name, _dump(arguments))]


# ---- MiniMax-M2: <minimax:tool_call><invoke name="f"><parameter name="k">v</parameter></invoke>...
_MINIMAX_INVOKE = re.compile(r'<invoke name="([^"]+)">(.*?)(?:</invoke>|$)', re.DOTALL)
_MINIMAX_PARAM = re.compile(r'<parameter name="([^"]+)">(.*?)(?:</parameter>|$)', re.DOTALL)


def parse_minimax_m2(body: str, types: ParamTypes) -> list[ParsedCall]:
    calls = []
    for invoke in _MINIMAX_INVOKE.finditer(body):
        name = invoke.group(1).strip()
        schema = types.get(name, {})
        arguments = {
            key: typed_value(_strip_one_newline(value), schema.get(key))
            for key, value in _MINIMAX_PARAM.findall(invoke.group(2))
        }
        calls.append(ParsedCall(name, _dump(arguments)))
    if not calls:
        raise MalformedCall('no <invoke name="..."> in the tool call')
    return calls


HERMES = ToolFormat("qwen3", "<tool_call>", "</tool_call>", parse_hermes, parse_hermes_unfinished)
QWEN3_CODER = ToolFormat("qwen3_coder", "<tool_call>", "</tool_call>", parse_qwen3_coder,
                         _last_call_unfinished(parse_qwen3_coder))
GLM4_MOE = ToolFormat("glm4_moe", "<tool_call>", "</tool_call>", parse_glm4_moe, _last_call_unfinished(parse_glm4_moe))
MINIMAX_M2 = ToolFormat("minimax_m2", "<minimax:tool_call>", "</minimax:tool_call>", parse_minimax_m2,
                        _last_call_unfinished(parse_minimax_m2))
