"""Output parsers on recorded outputs of each family: whole, split at every byte, random splits."""

from __future__ import annotations

import codecs
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deployments.output_deltas import ContentDelta, ParsedEvent, ReasoningDelta, ToolCallDelta
from deployments.chat.parsers.lexer import Marker, MarkerLexer, Text
from deployments.chat.parsers.selection import (
    ParseOptions,
    ParserNames,
    build_output_parser,
    infer_parser_names,
    resolve_parser_names,
)
from tests.unit.parser_recordings import FILE_TOOLS, QWEN3, RECORDINGS, WEATHER_TOOLS, Recording, merge_events

IDS = [r.name for r in RECORDINGS]
MARKUP = ("<tool_call", "</tool_call", "<think", "</think", "<|", "<function=", "<parameter", "<arg_", "<invoke",
          "minimax:")


def parse(recording: Recording, pieces: list[str]) -> list[ParsedEvent]:
    counter = itertools.count()
    options = ParseOptions(tools=recording.tools, parallel_tool_calls=recording.parallel_tool_calls,
                           prompt_text=recording.prompt_text, new_id=lambda: f"call_{next(counter)}")
    parser = build_output_parser(recording.names, options)
    assert parser is not None
    events: list[ParsedEvent] = []
    for piece in pieces:
        events += parser.feed(piece)
    return events + parser.finish()


def utf8_pieces(text: str, cuts: list[int]) -> list[str]:
    """The text's UTF-8 bytes cut at `cuts`, decoded incrementally as the detokenizer streams them."""
    data = text.encode()
    decoder = codecs.getincrementaldecoder("utf-8")()
    bounds = [0, *sorted(set(cuts)), len(data)]
    return [decoder.decode(data[a:b], final=b == len(data)) for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("recording", RECORDINGS, ids=IDS)
def test_whole_output_gives_the_recorded_events(recording):
    assert merge_events(parse(recording, [recording.output])) == recording.expected


@pytest.mark.parametrize("recording", RECORDINGS, ids=IDS)
def test_split_at_every_byte_gives_the_same_events(recording):
    size = len(recording.output.encode())
    for cut in range(1, size):
        assert merge_events(parse(recording, utf8_pieces(recording.output, [cut]))) == recording.expected, cut
    one_byte_each = utf8_pieces(recording.output, list(range(1, size)))
    events = parse(recording, one_byte_each)
    assert merge_events(events) == recording.expected
    for event in events:  # streamed piecemeal, still no markup in content or reasoning
        if isinstance(event, (ContentDelta, ReasoningDelta)):
            assert not any(m in event.text for m in MARKUP) or "tags" in recording.name, event


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_random_splits_give_the_same_events(data):
    recording = data.draw(st.sampled_from(RECORDINGS))
    size = len(recording.output.encode())
    cuts = data.draw(st.lists(st.integers(1, max(1, size - 1)), max_size=12))
    assert merge_events(parse(recording, utf8_pieces(recording.output, cuts))) == recording.expected


def test_content_streams_before_the_call_is_complete():
    recording = RECORDINGS[0]
    head = recording.output.split("<tool_call>")[0] + "<tool_c"
    counter = itertools.count()
    parser = build_output_parser(QWEN3, ParseOptions(tools=WEATHER_TOOLS, new_id=lambda: f"call_{next(counter)}"))
    events = merge_events(parser.feed(head))
    # All of the reasoning and the content is out; only the partial marker (and whitespace) waits.
    assert events == recording.expected[:2]
    events = parser.feed('all>\n{"name": "get_weather", "arguments": {"city": "Pa')
    assert events == []  # a call goes out whole, never half


def test_lexer_holds_back_only_possible_marker_prefixes():
    lexer = MarkerLexer()
    lexer.feed("a < b <tool")
    assert list(lexer.tokens(lambda: ("<tool_call>",))) == [Text("a < b ")]
    lexer.feed("_call>x")
    assert list(lexer.tokens(lambda: ("<tool_call>",))) == [Marker("<tool_call>"), Text("x")]
    lexer.feed("<tool")
    lexer.finish()
    assert list(lexer.tokens(lambda: ("<tool_call>",))) == [Text("<tool")]


def test_plain_models_and_tool_less_requests_get_no_parser():
    assert build_output_parser(ParserNames(None, None), ParseOptions(tools=WEATHER_TOOLS)) is None
    assert build_output_parser(ParserNames("qwen3", None), ParseOptions(tools=None)) is None


def test_tool_markup_stays_content_when_tools_are_off():
    parser = build_output_parser(QWEN3, ParseOptions(tools=None))
    text = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    events = merge_events(parser.feed(text) + parser.finish())
    assert events == [ContentDelta(text)]
    assert not any(isinstance(e, ToolCallDelta) for e in events)


@pytest.mark.parametrize("template, expected", [
    ("{{ '<|start|>assistant<|channel|>final<|message|>' }}", ParserNames("harmony", "harmony")),
    ("<tool_call>{{ tool_call | tojson }}</tool_call> <think>", ParserNames("qwen3", "qwen3")),
    ("<tool_call>\n<function={{ name }}>\n<parameter={{ k }}>", ParserNames("qwen3_coder", None)),
    ("<tool_call>{{ name }}<arg_key>{{ k }}</arg_key> </think>", ParserNames("glm4_moe", "qwen3")),
    ("<minimax:tool_call><invoke name=...> <think>", ParserNames("minimax_m2", "qwen3")),
    ("{% for m in messages %}<|im_start|>{{ m.role }}{% endfor %}", ParserNames(None, None)),
])
def test_parser_names_inferred_from_the_chat_template(template, expected):
    assert infer_parser_names(template) == expected


# ---- the generic format, and calls cut by max_tokens ---------------------------------------------------------
def test_a_template_without_tool_markup_gets_the_generic_format():
    chatml = "{% for m in messages %}<|im_start|>{{ m.role }}{% endfor %}"
    names = resolve_parser_names(None, None, chatml)
    assert names == ParserNames("generic", None) and names.tools_in_system_prompt
    assert not names.keeps_special_tokens(tools_enabled=True)  # its markers are plain text
    assert resolve_parser_names("qwen3", None, chatml) == ParserNames("qwen3", None)
    assert not resolve_parser_names(None, None, "<tool_call> <think>").tools_in_system_prompt
    counter = itertools.count()
    parser = build_output_parser(names, ParseOptions(tools=WEATHER_TOOLS, new_id=lambda: f"call_{next(counter)}"))
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "parameters": {"city": "Paris"}}\n</tool_call>'
    assert merge_events(parser.feed(text) + parser.finish()) == [
        ContentDelta("Let me check."), ToolCallDelta(0, '{"city": "Paris"}', "call_0", "get_weather")]


def _finish(names: ParserNames, text: str, cut: bool) -> list[ParsedEvent]:
    counter = itertools.count()
    parser = build_output_parser(names, ParseOptions(tools=WEATHER_TOOLS, new_id=lambda: f"call_{next(counter)}"))
    return merge_events(parser.feed(text) + parser.finish(cut=cut))


@pytest.mark.parametrize("names", [QWEN3, ParserNames("generic")], ids=["qwen3", "generic"])
def test_a_call_cut_by_max_tokens_keeps_its_arguments_as_written(names):
    head = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": '
    assert _finish(names, head + '{"city": "Par ', cut=True) == [
        ContentDelta("Sure."), ToolCallDelta(0, '{"city": "Par ', "call_0", "get_weather", unfinished=True)]
    assert _finish(names, head, cut=True) == [
        ContentDelta("Sure."), ToolCallDelta(0, "", "call_0", "get_weather", unfinished=True)]
    # Cut before the name: no call, and no half-written markup as content either.
    assert _finish(names, 'Sure.\n<tool_call>\n{"name": "get_wea', cut=True) == [ContentDelta("Sure.")]
    # Whole but for the end marker: a finished call.
    assert _finish(names, head + '{"city": "Paris"}}', cut=True) == [
        ContentDelta("Sure."), ToolCallDelta(0, '{"city": "Paris"}', "call_0", "get_weather")]
    # Not cut (a stop token ended it): the call as the model wrote it, as before.
    assert _finish(names, head + '{"city": "Par', cut=False) == [
        ContentDelta("Sure."), ToolCallDelta(0, '{"city": "Par', "call_0", "get_weather")]


def test_a_harmony_call_cut_by_max_tokens_is_unfinished():
    harmony = ParserNames("harmony", "harmony")
    text = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Par'
    assert _finish(harmony, text, cut=True) == [ToolCallDelta(0, '{"city": "Par', "call_0", "get_weather", True)]
    # <|call|> is a stop token: a whole call ends the output inside the body.
    assert _finish(harmony, text + 'is"}', cut=True) == [ToolCallDelta(0, '{"city": "Paris"}', "call_0", "get_weather")]


def test_an_xml_call_cut_by_max_tokens_is_unfinished_with_what_was_written():
    counter = itertools.count()
    options = ParseOptions(tools=FILE_TOOLS, new_id=lambda: f"call_{next(counter)}")
    parser = build_output_parser(ParserNames("qwen3_coder"), options)
    text = ("<tool_call>\n<function=run_shell>\n<parameter=command>\nls\n</parameter>\n</function>\n"
            "<function=read_file>\n<parameter=path>\nsrc/a")
    assert merge_events(parser.feed(text) + parser.finish(cut=True)) == [
        ToolCallDelta(0, '{"command": "ls"}', "call_0", "run_shell"),
        ToolCallDelta(1, '{"path": "src/a"}', "call_1", "read_file", unfinished=True)]
