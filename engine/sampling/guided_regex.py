"""Each GuidedDecoding kind as one regex over the output text (cheap: no vocabulary involved).

JSON schemas go through outlines-core's converter, with three repairs: keywords it would
silently ignore are refused; bounded integers/numbers get exact range regexes (it ignores
minimum/maximum); free-form objects, arrays and `{}` get a depth-limited JSON regex instead
of its depth-3 one, whose index takes ~10 s to build over a 49k vocabulary.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from outlines_core.json_schema import BOOLEAN, NULL, NUMBER, STRING, build_regex_from_schema

from engine.errors import InvalidRequestError
from engine.sampling.guided import GuidedDecoding
from engine.sampling.number_regex import NUMERIC_BOUNDS, EmptyRangeError, bounded_numeric_regex

# outlines-core's default: at most one space where JSON allows whitespace, so a model cannot
# spend its whole budget on blank lines.
WHITESPACE = r"[ ]?"
PRIMITIVE = f"{STRING}|{NUMBER}|{BOOLEAN}|{NULL}"
# Keywords that restrict valid documents but that the regex would not enforce.
UNSUPPORTED_KEYWORDS = (
    "not", "if", "then", "else", "patternProperties", "propertyNames", "dependentRequired",
    "dependentSchemas", "dependencies", "contains", "minContains", "maxContains",
    "unevaluatedProperties", "unevaluatedItems", "multipleOf",
)
# Keys whose value maps names to sub-schemas, and keys holding one or a list of sub-schemas.
_SCHEMA_MAPS = ("properties", "$defs", "definitions")
_SCHEMA_VALUES = ("items", "additionalProperties", "anyOf", "oneOf", "allOf", "prefixItems")
_ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment"}
_SENTINEL = "ORCHARDSLOT{}X"


def _object_regex(value: str) -> str:
    member = f"{STRING}{WHITESPACE}:{WHITESPACE}({value})"
    return rf"\{{{WHITESPACE}({member}({WHITESPACE},{WHITESPACE}{member})*)?{WHITESPACE}\}}"


def _array_regex(value: str) -> str:
    return rf"\[{WHITESPACE}(({value})({WHITESPACE},{WHITESPACE}({value}))*)?{WHITESPACE}\]"


def json_value_regex(depth: int) -> str:
    """Any JSON value with containers nested at most `depth` deep."""
    value = PRIMITIVE
    for _ in range(depth):
        value = f"{PRIMITIVE}|{_object_regex(value)}|{_array_regex(value)}"
    return value


# Two levels of containers: {"a": {"b": 1}, "c": [1, "x"]}. A third level multiplies index
# build time by ~25 (0.4 s -> 10 s on this CPU), too slow for a request to wait for.
FREE_DEPTH = 2
JSON_OBJECT_REGEX = _object_regex(json_value_regex(FREE_DEPTH - 1))


def escape_literal(text: str) -> str:
    """A literal for outlines-core's regex dialect (Rust regex-syntax)."""
    return "".join("\\" + ch if ch in r"\.+*?()|[]{}^$" else ch for ch in text)


@lru_cache(maxsize=256)
def guided_regex(guided: GuidedDecoding) -> str:
    """The regex the output must match in full; raises InvalidRequestError naming the problem."""
    if guided.kind == "json_object":
        return JSON_OBJECT_REGEX
    if guided.kind == "regex":
        if not guided.spec:
            _fail(guided, "the regex is empty")
        return guided.spec
    if guided.kind == "choice":
        return _choice_regex(guided)
    if guided.kind == "json_schema":
        return _schema_regex(guided)
    _fail(guided, f"unknown structured-output kind '{guided.kind}'")


def _fail(guided: GuidedDecoding, message: str) -> None:
    param = guided.param
    raise InvalidRequestError(f"Invalid '{param}': {message}", param=param)


def _choice_regex(guided: GuidedDecoding) -> str:
    try:
        choices = json.loads(guided.spec)
    except ValueError:
        choices = None
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        _fail(guided, "choices must be a non-empty list of non-empty strings")
    return "(" + "|".join(escape_literal(c) for c in choices) + ")"


def _schema_regex(guided: GuidedDecoding) -> str:
    try:
        schema = json.loads(guided.spec)
    except ValueError as exc:
        _fail(guided, f"the JSON schema is not valid JSON ({exc})")
    if schema is True or schema == {}:
        return json_value_regex(FREE_DEPTH)
    if not isinstance(schema, dict):
        _fail(guided, "the JSON schema must be an object")
    slots: dict[str, str] = {}
    try:
        rewritten = _rewrite(schema, "#", slots)
        regex = build_regex_from_schema(json.dumps(rewritten), WHITESPACE)
    except (ValueError, TypeError) as exc:
        _fail(guided, f"unsupported JSON schema: {str(exc).splitlines()[0]}")
    for name, slot_regex in slots.items():
        quoted = f'"{name}"'
        if quoted not in regex:
            _fail(guided, "unsupported JSON schema: a bounded number or free-form value sits where it cannot be honoured")
        regex = regex.replace(quoted, f"({slot_regex})")
    return regex


def _rewrite(node: Any, path: str, slots: dict[str, str]) -> Any:
    """A copy of the schema with refused keywords reported and special nodes replaced by slots."""
    if not isinstance(node, dict):
        return node
    for keyword in UNSUPPORTED_KEYWORDS:
        if keyword in node:
            raise ValueError(f"keyword '{keyword}' at {path} is not supported")
    if node.get("uniqueItems") is True:
        raise ValueError(f"keyword 'uniqueItems' at {path} is not supported")
    slot = _slot_regex(node, path)
    if slot is not None:
        name = _SENTINEL.format(len(slots))
        slots[name] = slot
        return {"const": name}
    out = dict(node)
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            out[key] = {k: _rewrite(v, f"{path}/{key}/{k}", slots) for k, v in node[key].items()}
    for key in _SCHEMA_VALUES:
        value = node.get(key)
        if isinstance(value, list):
            out[key] = [_rewrite(v, f"{path}/{key}/{i}", slots) for i, v in enumerate(value)]
        elif isinstance(value, dict):
            out[key] = _rewrite(value, f"{path}/{key}", slots)
    return out


def _slot_regex(node: dict, path: str) -> str | None:
    """Our own regex for nodes outlines-core would get wrong or make huge; None for the others."""
    kind = node.get("type")
    if kind in ("integer", "number") and any(k in node for k in NUMERIC_BOUNDS):
        try:
            return bounded_numeric_regex(node)
        except EmptyRangeError as exc:
            raise ValueError(f"{exc} at {path}") from None
    if set(node) <= _ANNOTATIONS:  # {}: any value
        return json_value_regex(FREE_DEPTH)
    free_object = kind == "object" and not any(
        k in node for k in ("properties", "required", "anyOf", "oneOf", "allOf", "$ref", "enum", "const")
    ) and node.get("additionalProperties", True) is True
    if free_object:
        return JSON_OBJECT_REGEX
    if kind == "array" and not any(k in node for k in ("items", "prefixItems", "minItems", "maxItems", "enum", "const")):
        return _array_regex(json_value_regex(FREE_DEPTH - 1))
    return None


__all__ = ["JSON_OBJECT_REGEX", "UNSUPPORTED_KEYWORDS", "escape_literal", "guided_regex", "json_value_regex"]
