"""Streams start at once (issue 26, part 5), in process over real engines: headers and the opening event go out
when the engine takes the request in, keep-alives while a long prefill runs, refusals still as HTTP statuses,
and one usage within a stream and between streamed and whole answers.

The prefill is made long for real: a per-step prefill budget of a few tokens spreads a long prompt over hundreds
of engine steps, as a slow CPU does with its measured budget.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from deployments.config import ModelConfig
from deployments.model_calls import GenerateJob, TextPrompt
from engine.sampling.params import SamplingParams
from tests.serve.local_stack import SentMessage, local_stack, send_streaming, wait_for

MODEL = "tiny/alpha"
KEEPALIVE_S = 0.05
LONG_PROMPT = " ".join(f"t{(7 * i) % 250}" for i in range(1200))


@pytest.fixture()
def slow_prefill(tiny_models) -> ModelConfig:
    """The long prompt takes ~600 engine steps to prefill (2 tokens a step)."""
    return ModelConfig(
        model_id=MODEL, model_path=str(tiny_models.alpha), context_length=4096,
        prefill_chunk_tokens=2, prefill_step_tokens=2,
    )


def messages_body(prompt: str, **fields) -> dict:
    """A body both /v1/messages and /v1/chat/completions take."""
    return {"model": MODEL, "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": prompt}],
            **fields}


def sse_events(body: str) -> list[tuple[str, str]]:
    """(kind, data) per SSE event of a body part: kind is the event's name, "data" when it has none, or
    "comment" for a comment line."""
    events = []
    for block in body.split("\n\n"):
        if not block:
            continue
        if block.startswith(":"):
            events.append(("comment", block[1:].strip()))
            continue
        fields = dict(line.split(": ", 1) for line in block.split("\n"))
        events.append((fields.get("event", "data"), fields["data"]))
    return events


def timeline(messages: list[SentMessage]) -> list[tuple[float, str, str]]:
    """(time sent, kind, data) of every event of a streamed response, in order."""
    return [(m.at, kind, data) for m in messages if m.body for kind, data in sse_events(m.body)]


async def _streamed(config: ModelConfig, path: str, body: dict) -> list[SentMessage]:
    async with local_stack([config], keepalive_s=KEEPALIVE_S) as stack:
        return [message async for message in send_streaming(stack.app, path, body)]


def test_anthropic_stream_opens_at_admission_and_pings_through_a_long_prefill(slow_prefill):
    sent = asyncio.run(_streamed(slow_prefill, "/v1/messages", messages_body(LONG_PROMPT, stream=True)))
    assert sent[0].status == 200 and sent[0].headers["content-type"].startswith("text/event-stream")
    # The request may wait a step in the engine's queue (comments only), then the opening is one write:
    # message_start and Anthropic's first ping.
    events = timeline(sent)
    queued = [kind for _, kind, _ in events].index("message_start")
    assert {kind for _, kind, _ in events[:queued]} <= {"comment"}
    events = events[queued:]
    kinds = [kind for _, kind, _ in events]
    opening = next(m for m in sent[1:] if "message_start" in m.body)
    assert sse_events(opening.body) == [events[0][1:], events[1][1:]] and kinds[:2] == ["message_start", "ping"]
    first_text = kinds.index("content_block_delta")
    pings = [at for at, kind, _ in events[2:first_text] if kind == "ping"]
    # The stream was open (headers and message_start out) while the prompt was still being prefilled: keep-alive
    # pings came between message_start and the first token, each after KEEPALIVE_S without an event.
    assert len(pings) >= 2 and kinds[2:first_text] == ["ping"] * len(pings) + ["content_block_start"]
    assert events[first_text][0] - events[0][0] >= 2 * KEEPALIVE_S
    start = json.loads(events[0][2])["message"]
    assert start["usage"]["input_tokens"] > 1200 and start["usage"]["cache_read_input_tokens"] == 0
    assert kinds[-2:] == ["message_delta", "message_stop"]


def test_openai_streams_open_with_the_role_chunk_and_keep_alive_comments(slow_prefill):
    async def scenario():
        async with local_stack([slow_prefill], keepalive_s=KEEPALIVE_S) as stack:
            chat_body = messages_body(LONG_PROMPT, stream=True)
            chat = [m async for m in send_streaming(stack.app, "/v1/chat/completions", chat_body)]
            completion = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 4, "stream": True}
            text = [m async for m in send_streaming(stack.app, "/v1/completions", completion)]
            return chat, text

    chat, text = asyncio.run(scenario())
    assert chat[0].status == 200 and chat[0].headers["content-type"].startswith("text/event-stream")
    events = timeline(chat)
    role_at = [kind for _, kind, _ in events].index("data")  # comments only while the request is queued
    assert {kind for _, kind, _ in events[:role_at]} <= {"comment"}
    events = events[role_at:]
    opening = json.loads(events[0][2])
    assert opening["object"] == "chat.completion.chunk"
    assert opening["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    first_content = next(i for i, (_, kind, data) in enumerate(events) if kind == "data" and '"content":"' in data
                         and '"role"' not in data)
    keepalives = [kind for _, kind, _ in events[1:first_content]]
    assert len(keepalives) >= 2 and set(keepalives) == {"comment"}
    assert {data for _, kind, data in events if kind == "comment"} == {"keep-alive"}
    assert events[-1][1:] == ("data", "[DONE]")
    # Completions open with nothing: keep-alive comments until the text.
    kinds = [kind for _, kind, _ in timeline(text)]
    assert text[0].status == 200 and kinds[:2] == ["comment", "comment"] and kinds[-1] == "data"


def test_a_client_that_leaves_during_the_prefill_aborts_the_request(slow_prefill):
    async def scenario():
        async with local_stack([slow_prefill], keepalive_s=KEEPALIVE_S) as stack:
            stream = send_streaming(stack.app, "/v1/messages", messages_body(LONG_PROMPT, stream=True))
            async for message in stream:
                if message.body and {kind for kind, _ in sse_events(message.body)} == {"ping"}:
                    break  # a keep-alive: the prefill runs; the client goes
            await stream.aclose()
            return await wait_for(lambda: _idle_stats(stack), timeout_s=10)

    stats = asyncio.run(scenario())
    assert stats["running"] == 0 and stats["kv_cache_bytes"] == 0
    assert stats["generation_tokens_total"] == 0 and 0 < stats["prompt_tokens_total"] < 1200


async def _idle_stats(stack) -> dict | None:
    """The model's stats once idle after some prefill (the start-up stats, before any step, read idle too)."""
    row = (await stack.http.get("/v1/queue/stats")).json()["models"][0]
    idle = row["running"] == row["waiting"] == row["kv_cache_bytes"] == 0
    return row if idle and row["prompt_tokens_total"] > 0 else None


@pytest.mark.parametrize("path, body, error_type", [
    ("/v1/chat/completions", messages_body("t1 t2", stream=True), "rate_limit_error"),
    ("/v1/messages", messages_body("t1 t2", stream=True), "rate_limit_error"),
])
def test_a_full_queue_is_still_429_before_any_stream_starts(tiny_models, path, body, error_type):
    config = ModelConfig(model_id=MODEL, model_path=str(tiny_models.alpha), cb_max_num_seqs=1)

    async def scenario():
        async with local_stack([config]) as stack:
            client = await stack.registry.route(MODEL)
            endless = SamplingParams(max_tokens=60000, ignore_eos=True)
            job = GenerateJob("held", TextPrompt(text="t1"), endless, stream=True)
            held = client.generate(job)
            await _until_admitted(held)  # taken in: the engine is full
            try:
                return [m async for m in send_streaming(stack.app, path, body)]
            finally:
                await held.aclose()

    sent = asyncio.run(scenario())
    assert sent[0].status == 429 and sent[0].headers["content-type"] == "application/json"
    assert sent[0].headers["retry-after"] == "1"
    error = json.loads("".join(m.body for m in sent[1:]))["error"]
    assert error["type"] == error_type and "max_num_seqs=1" in error["message"]


async def _until_admitted(chunks) -> None:
    while not (await anext(chunks)).admitted:
        pass


def _held_config(tiny_models, **fields) -> ModelConfig:
    """One decode slot, room for more in the queue."""
    return ModelConfig(model_id=MODEL, model_path=str(tiny_models.alpha), max_decode_seqs=1, max_num_seqs=4,
                       max_prefill_seqs=1, **fields)


async def _with_slot_held(stack, stream_while_held):
    """stream_while_held(held) runs while an endless request (`held`, which it may close) holds the only decode slot."""
    client = await stack.registry.route(MODEL)
    endless = SamplingParams(max_tokens=60000, ignore_eos=True)
    held = client.generate(GenerateJob("held", TextPrompt(text="t1"), endless, stream=True))
    await _until_admitted(held)
    try:
        return await stream_while_held(held)
    finally:
        await held.aclose()


def test_a_queued_request_gets_headers_at_once_comments_while_it_waits_and_its_opening_at_admission(tiny_models):
    """Waiting for a decode slot (here: behind an endless request; on a slow machine: behind a long prefill), the
    stream is open (bytes for the client's first-byte and idle timers) but sends no API event until it is taken in:
    message_start must tell the prefix-cache split, known only then."""

    async def scenario():
        async with local_stack([_held_config(tiny_models)], keepalive_s=KEEPALIVE_S) as stack:
            async def stream_while_held(held):
                sent = []
                async for message in send_streaming(stack.app, "/v1/messages", messages_body("t1 t2", stream=True)):
                    sent.append(message)
                    if len([m for m in sent if m.body]) == 4:  # three keep-alives while queued: free the slot
                        await held.aclose()
                return sent
            return await _with_slot_held(stack, stream_while_held)

    sent = asyncio.run(scenario())
    assert sent[0].status == 200 and sent[0].headers["content-type"].startswith("text/event-stream")
    events = timeline(sent)
    kinds = [kind for _, kind, _ in events]
    start = kinds.index("message_start")
    assert start >= 4 and kinds[:start] == ["comment"] * start
    assert kinds[start + 1] == "ping" and kinds[-2:] == ["message_delta", "message_stop"]
    # The prompt's count came with the queued chunk, the cache split with the admitted one: both in message_start
    # (the soak saw input_tokens 0 there for every request that waited).
    opening = json.loads(events[start][2])["message"]["usage"]
    final = json.loads(events[-2][2])["usage"]
    fields = ("input_tokens", "cache_read_input_tokens")
    assert {f: opening[f] for f in fields} == {f: final[f] for f in fields} and opening["input_tokens"] > 0


def test_a_queue_timeout_while_queued_is_an_error_event_in_the_open_stream(tiny_models):
    async def scenario():
        config = _held_config(tiny_models, queue_timeout=0.3)
        async with local_stack([config], keepalive_s=KEEPALIVE_S) as stack:
            async def stream_while_held(held):
                body = messages_body("t1 t2", stream=True)
                return [m async for m in send_streaming(stack.app, "/v1/messages", body)]
            return await _with_slot_held(stack, stream_while_held)

    sent = asyncio.run(scenario())
    assert sent[0].status == 200
    events = timeline(sent)
    assert {kind for _, kind, _ in events[:-1]} == {"comment"} and events[-1][1] == "error"
    error = json.loads(events[-1][2])
    assert error["type"] == "error" and error["error"]["type"] == "overloaded_error"


def test_usage_is_one_within_a_stream_and_between_streamed_and_whole_answers(tiny_models):
    """The same long prompt twice: the second hits the prefix cache. Its message_start tells the split its
    message_delta tells (input_tokens without the cache reads), and the whole answer tells it too; OpenAI's
    streamed usage (include_usage) is its whole answer's."""
    config = ModelConfig(model_id=MODEL, model_path=str(tiny_models.alpha), context_length=4096)
    prompt = LONG_PROMPT[:1200]

    async def scenario():
        async with local_stack([config]) as stack:
            first = await stack.http.post("/v1/messages", json=messages_body(prompt, stream=True))
            again = await stack.http.post("/v1/messages", json=messages_body(prompt, stream=True))
            whole = await stack.http.post("/v1/messages", json=messages_body(prompt))
            chat_streamed = await stack.http.post("/v1/chat/completions", json=messages_body(
                prompt, stream=True, stream_options={"include_usage": True}))
            chat_whole = await stack.http.post("/v1/chat/completions", json=messages_body(prompt))
            return first, again, whole, chat_streamed, chat_whole

    first, again, whole, chat_streamed, chat_whole = asyncio.run(scenario())
    input_fields = ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")

    def stream_usages(response) -> tuple[dict, dict]:
        events = {kind: json.loads(data) for kind, data in sse_events(response.text) if kind not in ("ping", "comment")}
        start, delta = events["message_start"]["message"]["usage"], events["message_delta"]["usage"]
        return {f: start[f] for f in input_fields}, {f: delta[f] for f in input_fields}

    start, delta = stream_usages(first)
    assert start == delta and start["cache_read_input_tokens"] == 0
    start, delta = stream_usages(again)
    assert start == delta and start["cache_read_input_tokens"] >= 32 and start["cache_creation_input_tokens"] == 0
    assert {f: whole.json()["usage"][f] for f in input_fields} == start
    streamed_usage = [json.loads(data) for kind, data in sse_events(chat_streamed.text)
                      if kind == "data" and data != "[DONE]"][-1]["usage"]
    whole_usage = chat_whole.json()["usage"]
    assert streamed_usage["prompt_tokens_details"]["cached_tokens"] >= 32
    assert {k: streamed_usage[k] for k in ("prompt_tokens", "prompt_tokens_details")} == {
        k: whole_usage[k] for k in ("prompt_tokens", "prompt_tokens_details")}


def test_responses_streams_keep_alive_with_events_codex_counts(slow_prefill, tiny_models):
    """Codex's idle timeout (300 s) counts events, not SSE comments: a Responses stream keeps alive with
    response.queued while the request waits in the queue (after response.created, status queued) and
    response.in_progress through a long prefill; every event is valid for the openai SDK, numbered in order."""
    from tests.serve.test_responses_local import named_events

    body = {"model": MODEL, "input": LONG_PROMPT, "max_output_tokens": 4, "temperature": 0, "stream": True}

    async def prefilling():
        async with local_stack([slow_prefill], keepalive_s=KEEPALIVE_S) as stack:
            return [m async for m in send_streaming(stack.app, "/v1/responses", body)]

    async def queued():
        async with local_stack([_held_config(tiny_models)], keepalive_s=KEEPALIVE_S) as stack:
            async def stream_while_held(held):
                sent = []
                async for message in send_streaming(stack.app, "/v1/responses", {**body, "input": "t1 t2"}):
                    sent.append(message)
                    if len([m for m in sent if m.body]) == 3:
                        await held.aclose()
                return sent
            return await _with_slot_held(stack, stream_while_held)

    for sent, waited in ((asyncio.run(prefilling()), "response.in_progress"), (asyncio.run(queued()), "response.queued")):
        assert sent[0].status == 200
        events = named_events("".join(m.body for m in sent[1:] if m.body))
        kinds = [e["type"] for e in events]
        first_item = kinds.index("response.output_item.added")
        if waited == "response.queued":
            assert kinds[0] == "response.created" and events[0]["response"]["status"] == "queued"
            opened = kinds.index("response.in_progress")
            assert opened >= 3 and kinds[1:opened] == ["response.queued"] * (opened - 1)
        else:
            assert kinds[:2] == ["response.created", "response.in_progress"]
            assert first_item >= 4 and kinds[2:first_item] == ["response.in_progress"] * (first_item - 2)
        assert kinds[-1] == "response.incomplete"
