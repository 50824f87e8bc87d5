"""Structured-output regexes (no MLX, no vocabulary): numeric ranges, formats, refusals, choices.

Python's `re` reads these regexes the same way outlines-core's Rust engine does (plain classes,
groups, counted repeats), so full matches here are what the guide will allow.
"""

from __future__ import annotations

import datetime
import json
import re
import uuid
from decimal import Decimal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.errors import InvalidRequestError
from engine.sampling.guided import GuidedDecoding
from engine.sampling.guided_regex import FORMAT_REGEXES, JSON_OBJECT_REGEX, guided_regex, json_schema_regex
from engine.sampling.number_regex import integer_range_regex, number_range_regex

bounds = st.one_of(st.none(), st.integers(-5000, 5000))


def matches(regex: str, text: str) -> bool:
    return re.fullmatch(regex, text) is not None


@settings(max_examples=150, deadline=None)
@given(low=bounds, high=bounds, probes=st.lists(st.integers(-10**7, 10**7), min_size=20, max_size=20))
def test_integer_ranges_match_exactly_the_integers_within_bounds(low, high, probes):
    if low is not None and high is not None and low > high:
        low, high = high, low
    regex = integer_range_regex(low, high)
    near = [b + d for b in (low, high) if b is not None for d in (-11, -10, -1, 0, 1, 9, 10)]
    for value in probes + near + [0, -1, 1]:
        inside = (low is None or value >= low) and (high is None or value <= high)
        assert matches(regex, str(value)) == inside, (low, high, value)
    assert not matches(regex, "01") and not matches(regex, "-0") and not matches(regex, "+1")


@settings(max_examples=100, deadline=None)
@given(low=bounds, high=bounds, texts=st.lists(st.decimals(-20000, 20000, places=3, allow_nan=False), min_size=30, max_size=30))
def test_number_ranges_only_match_values_within_bounds(low, high, texts):
    if low is not None and high is not None and low > high:
        low, high = high, low
    regex = number_range_regex(low, high)
    for value in texts + [Decimal(b) for b in (low, high) if b is not None]:
        text = format(value, "f")
        if matches(regex, text):
            assert (low is None or value >= low) and (high is None or value <= high), (low, high, text)
    for bound in (low, high):
        if bound is not None:
            assert matches(regex, str(bound)) and matches(regex, f"{bound}.0")


def test_schema_bounds_reach_the_regex():
    regex = json_schema_regex({"type": "object", "properties": {"age": {"type": "integer", "minimum": 18, "maximum": 65}},
                               "required": ["age"]})
    assert matches(regex, '{"age":18}') and matches(regex, '{ "age": 65 }')
    assert not matches(regex, '{"age":17}') and not matches(regex, '{"age":66}') and not matches(regex, '{"age":-20}')
    ratio = json_schema_regex({"type": "number", "exclusiveMinimum": 0, "maximum": 1})
    assert matches(ratio, "1") and matches(ratio, "1.000") and not matches(ratio, "1.5") and not matches(ratio, "0")


@pytest.mark.parametrize("name, good, bad", [
    ("date", ["2024-02-28", "1999-12-31", "2023-04-30"], ["2024-02-30", "2023-04-31", "٢٠٢٤-01-01", "24-01-01"]),
    ("time", ["23:59:59Z", "00:00:00.123+05:30"], ["24:00:00Z", "12:00:00", "12:00:00\\.5Z"]),
    ("date-time", ["2024-01-31T08:30:00Z"], ["2024-01-31 08:30:00Z", "12024-01-31T08:30:00Z"]),
    ("uuid", [str(uuid.UUID(int=12345))], ["1234"]),
    ("email", ["a.b@example.com"], ["no-at.example.com"]),
])
def test_string_formats_are_ascii_and_valid(name, good, bad):
    for text in good:
        assert matches(FORMAT_REGEXES[name], text), (name, text)
    for text in bad:
        assert not matches(FORMAT_REGEXES[name], text), (name, text)
    if name == "date":
        for text in good:
            datetime.date.fromisoformat(text)


def test_json_object_mode_allows_two_levels_of_containers():
    assert matches(JSON_OBJECT_REGEX, '{"a": 1, "b": [1, "x", null], "c": {"d": true}}')
    assert matches(JSON_OBJECT_REGEX, "{}")
    assert not matches(JSON_OBJECT_REGEX, "[1]") and not matches(JSON_OBJECT_REGEX, '{"a": {"b": {"c": 1}}}')


def test_choices_are_escaped_literals():
    regex = guided_regex(GuidedDecoding("choice", json.dumps(["a.b", "(x)+", "c|d"])))
    assert all(matches(regex, c) for c in ["a.b", "(x)+", "c|d"])
    assert not matches(regex, "axb") and not matches(regex, "c")


@pytest.mark.parametrize("schema, words", [
    ({"type": "array", "uniqueItems": True, "items": {"type": "integer"}}, "'uniqueItems' at #"),
    ({"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 3}}}, "'multipleOf' at #/properties/n"),
    ({"not": {"type": "string"}}, "'not'"),
    ({"type": "object", "patternProperties": {"^x": {}}}, "'patternProperties'"),
    ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, "'pattern' together with"),
    ({"type": "string", "format": "hostname-ish"}, "format 'hostname-ish'"),
    ({"type": "number", "minimum": 2, "maximum": 1}, "leave no value"),
    ({"type": "strin"}, "strin"),
    ([1, 2], "must be an object"),
])
def test_schemas_that_would_be_silently_wrong_are_refused(schema, words):
    with pytest.raises(InvalidRequestError) as refused:
        guided_regex(GuidedDecoding("json_schema", json.dumps(schema), param="guided_json"))
    assert refused.value.param == "guided_json" and words in refused.value.message, refused.value.message
