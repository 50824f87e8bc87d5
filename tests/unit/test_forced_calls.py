"""tool_choice required / named: the regex of one call in each family's markup.

Each regex must compile in outlines-core (the engine's structured-output index), accept the
family's canonical call text, refuse other functions, and read back as that call."""

from __future__ import annotations

import itertools
import json
import re
import string

import pytest
from outlines_core import Guide, Index, Vocabulary

from engine.errors import InvalidRequestError
from deployments.output_deltas import ToolCallDelta
from deployments.chat.parsers.forced import forced_call_regex
from deployments.chat.parsers.selection import ParseOptions, ParserNames, build_output_parser
from tests.unit.parser_recordings import FILE_TOOLS, merge_events

ARGS = {"path": "src/a.py", "limit": 5}
CALLS = {
    "qwen3": '<tool_call>\n{"name": "read_file", "arguments": {"path": "src/a.py", "limit": 5}}\n</tool_call>',
    "qwen3_coder": "<tool_call>\n<function=read_file>\n<parameter=path>\nsrc/a.py\n</parameter>\n"
                   "<parameter=limit>\n5\n</parameter>\n</function>\n</tool_call>",
    "glm4_moe": "<tool_call>read_file\n<arg_key>path</arg_key>\n<arg_value>src/a.py</arg_value>\n"
                "<arg_key>limit</arg_key>\n<arg_value>5</arg_value>\n</tool_call>",
    "minimax_m2": '<minimax:tool_call>\n<invoke name="read_file">\n<parameter name="path">src/a.py</parameter>\n'
                  '<parameter name="limit">5</parameter>\n</invoke>\n</minimax:tool_call>',
    "harmony": '<|channel|>commentary to=functions.read_file <|constrain|>json<|message|>{"path": "src/a.py", "limit": 5}',
}
CALLS["generic"] = CALLS["qwen3"]  # models without a tool format of their own: the Hermes convention
CHARS = sorted(set(string.printable))
VOCABULARY = Vocabulary(0, {c: [i + 1] for i, c in enumerate(CHARS)})  # token 0: EOS


@pytest.mark.parametrize("family", sorted(CALLS))
def test_forced_call_regex_accepts_the_call_and_reads_back(family):
    names = ParserNames(family, family if family == "harmony" else None)
    regex = forced_call_regex(names, FILE_TOOLS, "read_file")
    guide = Guide(Index(regex, VOCABULARY))  # compiles for the engine's masks
    for char in CALLS[family]:
        guide.advance(CHARS.index(char) + 1)
    assert guide.get_tokens() == [0]  # the call is complete: only EOS may follow, so the request ends there
    assert re.fullmatch(regex, CALLS[family])
    assert not re.fullmatch(regex, CALLS[family].replace("read_file", "run_shell"))
    assert re.fullmatch(forced_call_regex(names, FILE_TOOLS, None), CALLS[family])  # required: any tool
    counter = itertools.count()
    parser = build_output_parser(names, ParseOptions(tools=FILE_TOOLS, new_id=lambda: f"call_{next(counter)}"))
    events = merge_events(parser.feed(CALLS[family]) + parser.finish())
    assert len(events) == 1 and isinstance(events[0], ToolCallDelta)
    assert events[0].name == "read_file" and json.loads(events[0].arguments) == ARGS


def test_forced_call_needs_a_known_function_and_a_tool_format():
    with pytest.raises(InvalidRequestError) as unknown:
        forced_call_regex(ParserNames("qwen3"), FILE_TOOLS, "nope")
    assert unknown.value.param == "tool_choice"
    with pytest.raises(InvalidRequestError) as no_format:
        forced_call_regex(ParserNames(None, "qwen3"), FILE_TOOLS, None)
    assert "tool_call_parser" in no_format.value.message
