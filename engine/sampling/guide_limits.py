"""Bounds on a structured-output constraint, checked before anything compiles it (plain Python, no MLX).

An outlines-core index grows with the counted repetitions of its regex: `{"minLength": 10000000}` or
`((a{100}){100}){100}` asks for millions of automaton states, which took minutes and all of the machine's memory.
So a constraint is refused at once (400 naming the field and the limit) when its text, nesting, enum or repetition
counts are over a limit, or when no output within max_tokens could ever meet its minimums; a maximum no output can
reach is dropped (every output within max_tokens already meets it) instead of being compiled as given.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from engine.errors import InvalidRequestError
from engine.sampling.guided import GuidedDecoding

try:  # the regex parser behind `re` (Python 3.11+: re._parser; before: sre_parse)
    from re import _constants as _sre  # type: ignore[attr-defined]
    from re import _parser as _sre_parse  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover
    import sre_constants as _sre  # type: ignore[no-redef]
    import sre_parse as _sre_parse  # type: ignore[no-redef]

# The limits (docs/operations.md#limits): what could never build within guide_builder.py's budget is refused here, at
# once; the build's deadline and memory cap decide the rest. Over SmolLM2's 49k vocabulary on 2 cores a string of at
# most 1,024 characters built in ~4.5 s (200 MB), of 4,096 in 36 s (813 MB).
SPEC_BYTES = 256 * 1024  # a schema, regex or choice list (a forced tool call's regex is built from its schema)
SCHEMA_DEPTH = 32  # nested objects/arrays of the schema document itself
ENUM_VALUES = 1024  # values of one enum, or choices of guided_choice
REPEAT_COUNT = 2048  # any one minLength/maxLength/minItems/maxItems/min-maxProperties or {n,m} bound
# Positions that counted repetitions add ({n,m} is m copies of its body; nested ones multiply; plain text and * add
# none): build time and memory grow about linearly with them, up to ~18 s and ~800 MB for 4,096 of a wide class.
REGEX_POSITIONS = 4096
# Keywords counting characters, items or properties: (minimum keyword, maximum keyword).
_COUNTED = (("minLength", "maxLength"), ("minItems", "maxItems"), ("minProperties", "maxProperties"))


@dataclass(frozen=True)
class OutputReach:
    """The most an output can hold: max_tokens tokens of at most `token_chars` characters each."""

    max_tokens: int
    token_chars: int

    @property
    def chars(self) -> int:
        return self.max_tokens * max(1, self.token_chars)


def bound_guide(guided: GuidedDecoding, reach: OutputReach) -> GuidedDecoding:
    """The constraint to compile for an output of at most `reach`; raises InvalidRequestError over a limit."""
    param = guided.param
    if len(guided.spec.encode()) > SPEC_BYTES:
        _refuse(param, f"the constraint is {len(guided.spec.encode()):,} bytes, over the limit of {SPEC_BYTES:,}")
    if guided.kind == "choice":
        _check_choices(guided)
    elif guided.kind == "json_schema":
        guided = _bound_schema(guided, reach)
    return guided


def check_regex_size(regex: str, param: str, reach: OutputReach) -> None:
    """Refuse a regex whose counted repetitions unroll past REGEX_POSITIONS, or whose shortest match is longer than
    any output within max_tokens. A regex Python cannot parse (Rust-only syntax) is left to the bounded compile."""
    try:
        parsed = _sre_parse.parse(regex)
    except (re.error, RecursionError, OverflowError):
        return
    try:
        size = _measure(list(parsed), param)
    except RecursionError:
        _refuse(param, "the pattern nests too deeply")
    if size.unrolled > REGEX_POSITIONS:
        _refuse(param, f"its counted repetitions unroll to {size.unrolled:,} positions, over the limit of "
                       f"{REGEX_POSITIONS:,}")
    if size.shortest > reach.chars:
        _refuse(param, f"its shortest match is {size.shortest:,} characters, more than max_tokens {reach.max_tokens} "
                       f"can ever write (at most {reach.chars:,})")


def _refuse(param: str, message: str) -> None:
    raise InvalidRequestError(f"Invalid '{param}': {message}", param=param)


def _check_choices(guided: GuidedDecoding) -> None:
    try:
        choices = json.loads(guided.spec)
    except ValueError:
        return  # guided_regex names the problem
    if isinstance(choices, list) and len(choices) > ENUM_VALUES:
        _refuse(guided.param, f"{len(choices):,} choices, over the limit of {ENUM_VALUES:,}")


def _bound_schema(guided: GuidedDecoding, reach: OutputReach) -> GuidedDecoding:
    try:
        schema = json.loads(guided.spec)
    except (ValueError, RecursionError):
        return guided  # guided_regex names the problem
    bounded = _bound_node(schema, "#", 0, reach, guided.param)
    if bounded == schema:
        return guided
    return GuidedDecoding(guided.kind, json.dumps(bounded), param=guided.param)


def _bound_node(node: Any, path: str, depth: int, reach: OutputReach, param: str) -> Any:
    if depth > SCHEMA_DEPTH:
        _refuse(param, f"the schema nests deeper than the limit of {SCHEMA_DEPTH} at {path}")
    if isinstance(node, list):
        return [_bound_node(v, f"{path}/{i}", depth + 1, reach, param) for i, v in enumerate(node)]
    if not isinstance(node, dict):
        return node
    out = {k: _bound_node(v, f"{path}/{k}", depth + 1, reach, param) for k, v in node.items()}
    if isinstance(node.get("enum"), list) and len(node["enum"]) > ENUM_VALUES:
        _refuse(param, f"enum at {path} has {len(node['enum']):,} values, over the limit of {ENUM_VALUES:,}")
    for low_key, high_key in _COUNTED:
        low, high = node.get(low_key), node.get(high_key)
        if _is_count(low) and low > reach.chars:
            _refuse(param, f"{low_key} {low:,} at {path} can never be met within max_tokens {reach.max_tokens} "
                           f"(at most {reach.chars:,} characters)")
        if _is_count(high) and high > reach.chars:
            del out[high_key]  # no output within max_tokens can pass it: every output already meets it
            high = None
        for key, value in ((low_key, low), (high_key, high)):
            if _is_count(value) and value > REPEAT_COUNT:
                _refuse(param, f"{key} {value:,} at {path} is over the limit of {REPEAT_COUNT:,}")
    return out


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class _Size:
    shortest: int = 0  # characters of the shortest match
    positions: int = 0  # every position, counted repetitions unrolled
    unrolled: int = 0  # the positions that exist because a counted repetition copies its body (what costs)


def _measure(items: list, param: str) -> _Size:
    """The size of a parsed regex sequence."""
    size = _Size()
    for op, arg in items:
        if op in (_sre.MAX_REPEAT, _sre.MIN_REPEAT, getattr(_sre, "POSSESSIVE_REPEAT", None)):
            low, high, body = arg
            inner = _measure(list(body), param)
            for bound in (low, high):
                if bound != _sre.MAXREPEAT and bound > REPEAT_COUNT:
                    _refuse(param, f"a repetition count of {bound:,} is over the limit of {REPEAT_COUNT:,}")
            copies = max(1, low if high == _sre.MAXREPEAT else high)
            size.shortest += low * inner.shortest
            size.positions += copies * inner.positions
            size.unrolled += copies * inner.positions if copies > 1 else inner.unrolled
        elif op in (_sre.SUBPATTERN, getattr(_sre, "ATOMIC_GROUP", None), _sre.BRANCH):
            bodies = arg[1] if op == _sre.BRANCH else [arg[-1] if op == _sre.SUBPATTERN else arg]
            inner_sizes = [_measure(list(body), param) for body in bodies]
            size.shortest += min(i.shortest for i in inner_sizes)  # one branch, or the group's one body
            size.positions += sum(i.positions for i in inner_sizes)
            size.unrolled += sum(i.unrolled for i in inner_sizes)
        elif op not in (_sre.AT, _sre.ASSERT, _sre.ASSERT_NOT):  # a literal, a class, `.`: one character
            size.shortest += 1
            size.positions += 1
    return size


__all__ = ["ENUM_VALUES", "OutputReach", "REGEX_POSITIONS", "REPEAT_COUNT", "SCHEMA_DEPTH", "SPEC_BYTES",
           "bound_guide", "check_regex_size"]
