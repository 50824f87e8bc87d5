"""The Responses API's renderer and response store without a model: events accumulated by the openai SDK's own
stream state equal the whole response, failures end a stream with response.failed, the store's bounds and chains."""

from __future__ import annotations

import gc
import json
import tracemalloc
from typing import Any

import pytest
from openai import omit
from openai._models import construct_type
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from deployments.api.errors import PreviousResponseNotFoundError, ResponseNotFoundError, wire_error
from deployments.api.responses_render import ResponsesRenderer, response_shell
from deployments.api.responses_schemas import INPUT_ITEMS, FunctionCallItem, MessageItem, ResponsesRequest
from deployments.output_deltas import ToolCallDelta
from deployments.ingress.responses_store import ResponseStore, stored_size
from deployments.model_calls import StreamChunk, TokenLogprobInfo, TopTokenLogprob
from engine.errors import ContextLengthExceededError, EngineDeadError, QueueFullError
from engine.output.request_output import Finish, Usage
from engine.request import FinishReason

EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
BODY = ResponsesRequest.model_validate({"model": "m", "input": "hi", "instructions": "Be terse.", "temperature": 0.5})
STOP = Finish(FinishReason.STOP, Usage(100, 9, cached_tokens=64))
# One generation as the model side streams it: reasoning, text, then two calls (arguments whole).
CHUNKS = [
    StreamChunk(reasoning="Need the", num_tokens=2, prompt_tokens=100),
    StreamChunk(reasoning=" weather.", text="Checking", num_tokens=3),
    StreamChunk(text=" both.", tool_calls=[ToolCallDelta(0, '{"city": "Paris"}', "call_a1", "get_weather")]),
    StreamChunk(tool_calls=[ToolCallDelta(1, '{"city": "Oslo"}', "call_b2", "get_weather")], num_tokens=4,
                finish=STOP),
]


def renderer(stored: list[dict[str, Any]] | None = None) -> ResponsesRenderer:
    return ResponsesRenderer(response_shell(BODY, [], "resp_1"), stored.append if stored is not None else None)


def events_of(sse: str) -> list[dict[str, Any]]:
    events = []
    for block in sse.strip().split("\n\n"):
        name, data = block.split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert name == f"event: {payload['type']}"
        events.append(payload)
    return events


def without_ids(response: dict[str, Any]) -> dict[str, Any]:
    response = json.loads(json.dumps(response))
    response.pop("completed_at")
    for item in response["output"]:
        item.pop("id")
    return response


def test_streamed_items_accumulate_to_the_whole_response():
    stored: list[dict[str, Any]] = []
    whole = renderer(stored).completion([_merged(CHUNKS)])
    stream = renderer()
    events = events_of("".join(stream.sse(chunk) for chunk in CHUNKS) + stream.sse_end())
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    state = ResponseStreamState(input_tools=[], text_format=omit)
    for payload in events:
        state.handle_event(EVENTS.validate_python(payload))
    accumulated = state._completed_response.model_dump(mode="json", exclude_unset=True, by_alias=True)
    for item in accumulated["output"]:  # what the SDK's parse adds
        item.pop("parsed_arguments", None)
        for part in item.get("content") or []:
            part.pop("parsed", None)
    assert without_ids(accumulated) == without_ids(whole) == without_ids(events[-1]["response"])
    assert stored == [whole]
    Response.model_validate(whole)
    assert [(i["type"], i["status"]) for i in whole["output"]] == [
        ("reasoning", "completed"), ("message", "completed"), ("function_call", "completed"),
        ("function_call", "completed")]
    assert whole["output"][0]["content"] == [{"type": "reasoning_text", "text": "Need the weather."}]
    assert whole["output"][1]["content"][0]["text"] == "Checking both."
    assert [(c["call_id"], c["id"], c["arguments"]) for c in whole["output"][2:]] == [
        ("call_a1", "fc_a1", '{"city": "Paris"}'), ("call_b2", "fc_b2", '{"city": "Oslo"}')]
    assert whole["usage"] == {
        "input_tokens": 100, "input_tokens_details": {"cached_tokens": 64, "cache_write_tokens": 0},
        "output_tokens": 9, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 109}
    assert whole["instructions"] == "Be terse." and whole["temperature"] == 0.5 and whole["status"] == "completed"
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    calls = kinds[kinds.index("response.function_call_arguments.delta") - 1:]
    assert calls == ["response.output_item.added", "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done"] * 2 + ["response.completed"]


def test_an_opened_stream_starts_once_and_keeps_alive_with_in_progress_events():
    """Keep-alives are events (Codex's idle timeout counts events, not comments): response.in_progress with the
    output so far, numbered in order."""
    stream = renderer()
    text = stream.sse_start(CHUNKS[0]) + stream.sse_keepalive() + "".join(stream.sse(chunk) for chunk in CHUNKS)
    decoded = events_of(text)
    plain = renderer()
    expected = [e["type"] for e in events_of("".join(plain.sse(chunk) for chunk in CHUNKS))]
    assert [e["type"] for e in decoded] == expected[:2] + ["response.in_progress"] + expected[2:]
    assert [e["sequence_number"] for e in decoded] == list(range(len(expected) + 1))
    assert decoded[2]["response"]["status"] == "in_progress" and decoded[2]["response"]["output"] == []


def _merged(chunks: list[StreamChunk]) -> StreamChunk:
    total = StreamChunk()
    for chunk in chunks:
        total.merge(StreamChunk(**vars(chunk)))
    return total


@pytest.mark.parametrize(("error", "code"), [
    (EngineDeadError("the engine stopped"), "server_error"),
    (QueueFullError("queue is full"), "rate_limit_exceeded"),
    (ContextLengthExceededError("too long", param="input"), "context_length_exceeded"),
])
def test_a_failure_mid_stream_ends_it_with_response_failed(error, code):
    stream = renderer()
    text = stream.sse(StreamChunk(text="Hel", num_tokens=1, prompt_tokens=5)) + stream.sse_error(wire_error(error))
    events = events_of(text)
    for payload in events[:-1]:
        EVENTS.validate_python(payload)
    failed = events[-1]
    # Codex reads context_length_exceeded in response.failed (its retry and compaction decisions), a code the SDK's
    # Literal lacks: the SDK parses events leniently (construct_type), the others are checked strictly too.
    assert construct_type(type_=ResponseStreamEvent, value=failed).response.error.code == code
    if code != "context_length_exceeded":
        EVENTS.validate_python(failed)
    assert [e["type"] for e in events[-2:]] == ["response.output_text.delta", "response.failed"]
    assert failed["sequence_number"] == len(events) - 1
    assert failed["response"]["status"] == "failed" and failed["response"]["error"] == {"code": code,
                                                                                     "message": error.message}
    assert failed["response"]["output"][0]["status"] == "in_progress"
    assert failed["response"]["output"][0]["content"][0]["text"] == "Hel"
    before_any = events_of(renderer().sse_error(wire_error(error)))  # a stream that fails before its first chunk
    assert [e["type"] for e in before_any] == ["response.created", "response.in_progress", "response.failed"]


def test_logprobs_in_deltas_and_the_output_text_part():
    info = TokenLogprobInfo("Hi", [72, 105], -0.5, [TopTokenLogprob("Hi", [72, 105], -0.5)])
    chunk = StreamChunk(text="Hi", logprobs=[info], num_tokens=1, finish=Finish(FinishReason.LENGTH, Usage(3, 1)))
    events = events_of(renderer().sse(chunk))
    for payload in events:
        EVENTS.validate_python(payload)
    delta = next(e for e in events if e["type"] == "response.output_text.delta")
    assert delta["logprobs"] == [{"token": "Hi", "logprob": -0.5, "top_logprobs": [{"token": "Hi", "logprob": -0.5}]}]
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.incomplete"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["content"][0]["logprobs"] == [
        {"token": "Hi", "bytes": [72, 105], "logprob": -0.5, "top_logprobs": [{"token": "Hi", "bytes": [72, 105],
                                                                              "logprob": -0.5}]}]


# ---- the store ----------------------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def stored_response(response_id: str, text: str) -> dict[str, Any]:
    return {"id": response_id, "output": [{"id": "msg_1", "type": "message", "status": "completed",
                                           "role": "assistant", "content": [{"type": "output_text", "text": text,
                                                                             "annotations": [], "logprobs": []}]}]}


def test_store_keeps_chains_in_order_and_names_what_is_gone():
    store = ResponseStore()
    store.put(stored_response("r1", "one"), [MessageItem(role="user", content="q1")], None)
    call = FunctionCallItem(type="function_call", call_id="c", name="f", arguments="{}")
    store.put(stored_response("r2", "two"), [call], "r1")
    history = store.history("r2")
    assert [type(i).__name__ for i in history] == ["MessageItem", "MessageItem", "FunctionCallItem", "MessageItem"]
    assert history[0].content == "q1" and history[1].content[0].text == "one" and history[3].content[0].text == "two"
    store.delete("r1")
    with pytest.raises(PreviousResponseNotFoundError) as gone:
        store.history("r2")
    assert gone.value.param == "previous_response_id" and "'r1'" in gone.value.message
    with pytest.raises(ResponseNotFoundError):
        store.delete("r1")


def test_store_is_bounded_by_count_least_recently_used_first_and_by_idle_time():
    clock = Clock()
    store = ResponseStore(max_responses=2, ttl_s=10.0, clock=clock)
    store.put(stored_response("a", "x"), [], None)
    store.put(stored_response("b", "x"), [], None)
    store.get("a")  # used: b is now the least recently used
    store.put(stored_response("c", "x"), [], None)
    assert len(store) == 2 and store.get("a") and store.get("c")
    with pytest.raises(ResponseNotFoundError):
        store.get("b")
    clock.now = 8.0
    store.get("a")
    clock.now = 15.0  # c unused for 15 s, a for 7 s
    assert len(store) == 1 and store.get("a")
    with pytest.raises(ResponseNotFoundError):
        store.get("c")


def test_store_is_bounded_by_bytes_least_recently_used_first():
    one = stored_size(stored_response("a", "x" * 1000),
                      INPUT_ITEMS.validate_python(stored_response("a", "x" * 1000)["output"]))
    store = ResponseStore(max_responses=100, max_bytes=int(2.5 * one))
    for name in "abc":
        store.put(stored_response(name, "x" * 1000), [], None)
        if name == "a":
            assert store.stored_bytes == one
    assert len(store) == 2 and store.stored_bytes == 2 * one and store.get("b") and store.get("c")
    with pytest.raises(ResponseNotFoundError):
        store.get("a")
    # One request with a large image (a data URL in its input) over the whole bound: answered, never stored.
    store.put(stored_response("big", "y"), [MessageItem(role="user", content="z" * (3 * one))], None)
    assert len(store) == 2 and store.stored_bytes == 2 * one
    with pytest.raises(ResponseNotFoundError):
        store.get("big")
    store.delete("b")
    assert store.stored_bytes == one


ISSUE_59_ECHO = 7_000_000  # the issue's strings: user, prompt_cache_key and safety_identifier of 7 MB each


def echoing(response_id: str) -> tuple[dict[str, Any], list[Any]]:
    """A response echoing three 7 MB ids, as the ingress stored them before they were bounded (request_limits)."""
    echo = {name: name[0] * ISSUE_59_ECHO for name in ("user", "prompt_cache_key", "safety_identifier")}
    response = {**stored_response(response_id, "x"), **echo, "metadata": {"k": "v"}}
    return response, [MessageItem(role="user", content="q")]


def empty_parts(response_id: str) -> tuple[dict[str, Any], list[Any]]:
    """100,000 empty text parts: 3 MB of JSON, no tokens, and about 50 MB of Python objects."""
    items = INPUT_ITEMS.validate_python([{"role": "user", "content": [{"type": "input_text", "text": ""}] * 100_000}])
    return stored_response(response_id, "x"), items


def long_text(response_id: str) -> tuple[dict[str, Any], list[Any]]:
    return stored_response(response_id, "y" * 2_000_000), [MessageItem(role="user", content="q" * 2_000_000)]


@pytest.mark.parametrize("make", [echoing, empty_parts, long_text])
def test_store_counts_the_bytes_a_response_holds(make):
    """stored_bytes against the memory the store really keeps (tracemalloc): never less than 90% of it (the bound
    holds), never more than twice (a bound that refused what fits would be wrong the other way)."""
    store = ResponseStore(max_bytes=1 << 30)
    gc.collect()
    tracemalloc.start()
    try:
        store.put(*make("r1"), None)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert len(store) == 1 and store.get("r1")
    assert 0.9 * held <= store.stored_bytes <= 2 * held, (store.stored_bytes, held)
    if make is echoing:
        assert store.stored_bytes > 3 * ISSUE_59_ECHO
