"""guide_limits: a structured-output constraint over a limit, or out of max_tokens' reach, is refused (or its
unreachable maximum dropped) before anything compiles it (issue 48: such schemas took minutes and the server)."""

from __future__ import annotations

import json

import pytest

from engine.errors import InvalidRequestError
from engine.sampling.guide_limits import (
    ENUM_VALUES, REGEX_POSITIONS, REPEAT_COUNT, SCHEMA_DEPTH, SPEC_BYTES, OutputReach, bound_guide, check_regex_size,
)
from engine.sampling.guided import GuidedDecoding
from engine.sampling.guided_regex import guided_regex

REACH = OutputReach(max_tokens=4, token_chars=16)  # at most 64 characters


def schema(value: dict, param: str = "response_format") -> GuidedDecoding:
    return GuidedDecoding("json_schema", json.dumps(value), param=param)


def refusal(guided: GuidedDecoding, reach: OutputReach = REACH) -> str:
    with pytest.raises(InvalidRequestError) as caught:
        bounded = bound_guide(guided, reach)
        check_regex_size(guided_regex(bounded), bounded.param, reach)
    assert caught.value.param == guided.param
    return caught.value.message


def test_the_reported_string_schema_is_refused_for_its_minimum() -> None:
    message = refusal(schema({"type": "string", "minLength": 10_000_000, "maxLength": 100_000_000}))
    assert "minLength 10,000,000 at # can never be met within max_tokens 4 (at most 64 characters)" in message


def test_the_reported_array_schema_is_refused_for_its_minimum() -> None:
    message = refusal(schema({"type": "array", "items": {"type": "string"}, "minItems": 1_000_000,
                              "maxItems": 10_000_000}))
    assert "minItems 1,000,000 at #" in message


def test_an_unreachable_maximum_is_dropped_and_the_rest_kept() -> None:
    guided = schema({"type": "object", "properties": {"name": {"type": "string", "maxLength": 100_000_000}},
                     "required": ["name"]})
    bounded = bound_guide(guided, REACH)
    assert json.loads(bounded.spec) == {"type": "object", "properties": {"name": {"type": "string"}},
                                        "required": ["name"]}
    assert bounded.param == guided.param


def test_a_reachable_bound_over_the_limit_is_refused_naming_the_limit() -> None:
    wide = OutputReach(max_tokens=8192, token_chars=16)
    message = refusal(schema({"type": "string", "minLength": REPEAT_COUNT + 1}), wide)
    assert f"minLength {REPEAT_COUNT + 1:,} at # is over the limit of {REPEAT_COUNT:,}" in message


def test_a_schema_within_the_limits_is_compiled_as_given() -> None:
    guided = schema({"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string",
                     "maxLength": 8}, "maxItems": 3}}, "required": ["tags"]})
    assert bound_guide(guided, REACH) is guided
    check_regex_size(guided_regex(guided), guided.param, REACH)


def test_the_reported_nested_regex_is_refused_for_its_size() -> None:
    message = refusal(GuidedDecoding("regex", "((a{100}){100}){100}", param="guided_regex"),
                      OutputReach(max_tokens=10**6, token_chars=16))
    assert f"unroll to 1,000,000 positions, over the limit of {REGEX_POSITIONS:,}" in message


def test_a_regex_repetition_count_over_the_limit_is_refused() -> None:
    message = refusal(GuidedDecoding("regex", f"x{{0,{REPEAT_COUNT + 1}}}", param="guided_regex"))
    assert f"a repetition count of {REPEAT_COUNT + 1:,} is over the limit" in message


def test_a_regex_whose_shortest_match_is_out_of_reach_is_refused() -> None:
    message = refusal(GuidedDecoding("regex", "[a-z]{65}", param="guided_regex"))
    assert "its shortest match is 65 characters, more than max_tokens 4 can ever write (at most 64)" in message
    check_regex_size("[a-z]{64}", "guided_regex", REACH)  # exactly the reach: possible


def test_alternatives_count_their_shortest_branch_and_all_positions() -> None:
    check_regex_size("(a{60}|b)c{3}", "guided_regex", REACH)  # shortest: b + ccc
    message = refusal(GuidedDecoding("regex", "(a{300}|b{300}){40}", param="guided_regex"),
                      OutputReach(max_tokens=10**6, token_chars=16))
    assert "unroll to 24,000 positions" in message


def test_enum_choices_depth_and_size_limits() -> None:
    assert "over the limit of" in refusal(schema({"enum": list(range(ENUM_VALUES + 1))}))
    assert f"{ENUM_VALUES + 1:,} choices" in refusal(
        GuidedDecoding("choice", json.dumps([f"c{i}" for i in range(ENUM_VALUES + 1)]), param="guided_choice"))
    nested: dict = {"type": "string"}
    for _ in range(SCHEMA_DEPTH):
        nested = {"type": "array", "items": nested}
    assert f"nests deeper than the limit of {SCHEMA_DEPTH}" in refusal(schema(nested))
    huge = GuidedDecoding("regex", "a" * (SPEC_BYTES + 1), param="guided_regex")
    assert f"over the limit of {SPEC_BYTES:,}" in refusal(huge)


def test_plain_text_and_unbounded_repetition_cost_nothing() -> None:
    # A forced tool call's regex is mostly literal text (names, keys): only counted repetitions are unrolled.
    wide = OutputReach(max_tokens=10**6, token_chars=16)
    check_regex_size("x" * (REGEX_POSITIONS * 3) + "[a-z]*", "tool_choice", wide)
    check_regex_size(f"(([a-z]{{{REPEAT_COUNT}}}){{{REGEX_POSITIONS // REPEAT_COUNT}}})*", "tool_choice", wide)  # at it
    message = refusal(GuidedDecoding("regex", f"[a-z]{{{REPEAT_COUNT}}}[0-9]{{{REGEX_POSITIONS - REPEAT_COUNT}}}[A-Z]{{2}}",
                                     param="guided_regex"), wide)
    assert f"unroll to {REGEX_POSITIONS + 2:,} positions" in message
