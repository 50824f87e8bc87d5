"""One request of any kind the soak sends, read to its end (or cut on purpose) and checked.

Kinds: OpenAI chat completions and completions, Anthropic messages; streamed or not. Every answer is checked:
status (200; 429 with Retry-After and the API's error body), body or stream shape (OpenAI streams end with
[DONE] after a usage chunk, Anthropic's with message_stop), finish/stop reason, usage (completion tokens <=
max_tokens, == max_tokens when cut by length, totals add up), no stop string in the text, JSON output that
parses and fits its schema. A request cut by the client closes its connection (not returned to the pool).
Needs aiohttp only.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from deployments.cli.loadgen.client import SSEReader

PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "messages": "/v1/messages"}
OPENAI_FINISH = ("stop", "length")
ANTHROPIC_STOP = ("end_turn", "max_tokens", "stop_sequence")
BODY_KEEP_CHARS = 2000
# Random benchmark models (tests.support.random_model) spell token N as "tN": such text shows its token count.
WORD_TOKEN = re.compile(r"t\d+")
WORD_TOKEN_TEXT = re.compile(r"(?:t\d+)+")
ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
                 "required": ["answer"], "additionalProperties": False}


@dataclass
class Cut:
    """Where the client closes a stream: after this many SSE data events (0: right after the response
    headers), or, with `at_s`, that many seconds after sending, whatever has arrived by then."""

    after_events: int
    at_s: float | None = None


@dataclass
class Shape:
    """What one request sends."""

    index: int
    model: str
    api: str  # a PATHS key
    stream: bool
    max_tokens: int
    temperature: float
    prompt: str
    stop: list[str] = field(default_factory=list)
    json_schema: bool = False
    cut: Cut | None = None


@dataclass
class Reading:
    """What the answer said, whatever its API."""

    text: str = ""
    finish: str | None = None  # finish_reason / stop_reason as sent
    stop_sequence: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    total_tokens: int | None = None
    events: int = 0  # SSE data events read
    done: bool = False  # [DONE] / message_stop seen
    stream_error: str | None = None
    problems: list[str] = field(default_factory=list)


@dataclass
class Answer:
    shape: Shape
    outcome: str  # ok, overload, disconnected, server_error, client_error, stream_error, invalid, hung, connection_error
    status: int | None
    latency_s: float
    ttft_s: float | None = None
    events: int = 0
    finish: str | None = None
    completion_tokens: int | None = None
    problems: list[str] = field(default_factory=list)
    body: str | None = None  # kept for anything but ok / disconnected


def request_body(shape: Shape) -> dict[str, Any]:
    body: dict[str, Any] = {"model": shape.model, "max_tokens": shape.max_tokens, "temperature": shape.temperature,
                            "stream": shape.stream}
    if shape.api == "completions":
        body["prompt"] = shape.prompt
    else:
        body["messages"] = [{"role": "user", "content": shape.prompt}]
    if shape.stop:
        body["stop_sequences" if shape.api == "messages" else "stop"] = shape.stop
    if shape.stream and shape.api != "messages":
        body["stream_options"] = {"include_usage": True}
    if shape.json_schema:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}}
    return body


# ---- sending
async def send(session: aiohttp.ClientSession, base_url: str, shape: Shape, timeout_s: float) -> Answer:
    """Never raises (but for cancellation): whatever happens becomes the Answer's outcome."""
    started = time.perf_counter()
    answer = Answer(shape, "ok", None, 0.0)
    reading = Reading()
    cut_at = shape.cut.at_s if shape.cut is not None else None
    try:
        await asyncio.wait_for(_exchange(session, base_url, shape, answer, reading, started),
                               min(timeout_s, cut_at) if cut_at is not None else timeout_s)
    except asyncio.TimeoutError:
        answer.outcome = "disconnected" if cut_at is not None and cut_at < timeout_s else "hung"
    except (aiohttp.ClientError, OSError) as exc:
        answer.outcome, answer.body = "connection_error", f"{type(exc).__name__}: {exc}"[:BODY_KEEP_CHARS]
    answer.latency_s = time.perf_counter() - started
    answer.events, answer.finish, answer.completion_tokens = reading.events, reading.finish, reading.completion_tokens
    if answer.outcome in ("ok", "disconnected"):
        _judge(answer, reading)
    return answer


async def _exchange(session: aiohttp.ClientSession, base_url: str, shape: Shape, answer: Answer,
                    reading: Reading, started: float) -> None:
    async with session.post(base_url.rstrip("/") + PATHS[shape.api], json=request_body(shape)) as resp:
        answer.status = resp.status
        try:
            if resp.status != 200:
                _refusal(answer, resp.status, resp.headers.get("Retry-After"), await resp.text())
            elif not shape.stream:
                _read_body(shape, await resp.read(), reading)
            elif await _read_stream(resp, shape, answer, reading, started):
                answer.outcome = "disconnected"
        finally:
            if answer.outcome == "disconnected" or not resp.content.at_eof():
                resp.close()  # closes the connection itself: the server sees the client go


async def _read_stream(resp: aiohttp.ClientResponse, shape: Shape, answer: Answer, reading: Reading,
                       started: float) -> bool:
    """Read the SSE stream; True if the client cut it (per shape.cut) before it ended."""
    check = AnthropicStream(reading) if shape.api == "messages" else OpenAIStream(reading, shape.api)
    cut_after = shape.cut.after_events if shape.cut is not None and shape.cut.at_s is None else None
    if cut_after == 0:
        return True
    sse = SSEReader()
    async for data in resp.content.iter_any():
        for payload in sse.feed(data):
            reading.events += 1
            before = len(reading.text)
            check.feed(payload)
            if answer.ttft_s is None and len(reading.text) > before:
                answer.ttft_s = time.perf_counter() - started
        if cut_after is not None and reading.events >= cut_after and not reading.done:
            return True
    check.close()
    return False


def _refusal(answer: Answer, status: int, retry_after: str | None, text: str) -> None:
    answer.body = text[:BODY_KEEP_CHARS]
    if status >= 500:
        answer.outcome = "server_error"
    elif status != 429:
        answer.outcome = "client_error"
    else:
        answer.outcome = "overload"
        if retry_after is None or not retry_after.strip().isdigit():
            answer.problems.append(f"429 without a whole-seconds Retry-After (got {retry_after!r})")
        problem = _error_shape_problem(answer.shape.api, text)
        if problem:
            answer.problems.append(problem)
        if answer.problems:
            answer.outcome = "invalid"


def _error_shape_problem(api: str, text: str) -> str | None:
    try:
        body = json.loads(text)
    except ValueError:
        return "error body is not JSON"
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict) or not isinstance(error.get("message"), str) or not isinstance(error.get("type"), str):
        return "error body lacks error.message / error.type"
    if api == "messages" and body.get("type") != "error":
        return "Anthropic error body without type: error"
    return None


# ---- whole bodies
def _read_body(shape: Shape, raw: bytes, reading: Reading) -> None:
    try:
        body = json.loads(raw)
    except ValueError:
        reading.problems.append("body is not JSON")
        return
    try:
        if shape.api == "messages":
            _read_message(body, reading)
        else:
            _read_openai(body, shape.api, reading)
    except (KeyError, IndexError, TypeError, AttributeError) as exc:
        reading.problems.append(f"malformed body ({type(exc).__name__}: {exc})")
    reading.done = True


def _read_openai(body: dict[str, Any], api: str, reading: Reading) -> None:
    expected = "chat.completion" if api == "chat" else "text_completion"
    if body["object"] != expected:
        reading.problems.append(f"object {body['object']!r}, expected {expected!r}")
    choices = body["choices"]
    if len(choices) != 1:
        reading.problems.append(f"{len(choices)} choices")
    choice = choices[0]
    reading.text = (choice["message"]["content"] or "") if api == "chat" else choice["text"]
    reading.finish = choice["finish_reason"]
    _note_openai_usage(body["usage"], reading)


def _read_message(body: dict[str, Any], reading: Reading) -> None:
    if body["type"] != "message" or body["role"] != "assistant":
        reading.problems.append(f"type {body['type']!r} role {body['role']!r}")
    for block in body["content"]:
        if block["type"] != "text":
            reading.problems.append(f"unexpected content block {block['type']!r}")
        reading.text += block.get("text", "")
    reading.finish, reading.stop_sequence = body["stop_reason"], body["stop_sequence"]
    usage = body["usage"]
    reading.prompt_tokens = usage["input_tokens"] + usage.get("cache_read_input_tokens", 0)
    reading.completion_tokens = usage["output_tokens"]


def _note_openai_usage(usage: dict[str, Any], reading: Reading) -> None:
    reading.prompt_tokens = usage["prompt_tokens"]
    reading.completion_tokens = usage["completion_tokens"]
    reading.total_tokens = usage["total_tokens"]


# ---- streams
class OpenAIStream:
    """Chunks, one finish_reason, a usage chunk (stream_options.include_usage), then [DONE] and nothing after."""

    def __init__(self, reading: Reading, api: str) -> None:
        self.reading = reading
        self.object = "chat.completion.chunk" if api == "chat" else "text_completion"
        self.chat = api == "chat"

    def feed(self, data: bytes) -> None:
        r = self.reading
        if r.done:
            r.problems.append("data after [DONE]")
        if data.strip() == b"[DONE]":
            r.done = True
            return
        try:
            chunk = json.loads(data)
            if chunk.get("error"):
                r.stream_error = json.dumps(chunk)[:BODY_KEEP_CHARS]
                return
            if chunk["object"] != self.object:
                r.problems.append(f"chunk object {chunk['object']!r}")
            for choice in chunk["choices"]:
                self._choice(choice)
            if chunk.get("usage"):
                if r.completion_tokens is not None:
                    r.problems.append("two usage chunks")
                _note_openai_usage(chunk["usage"], r)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            r.problems.append(f"malformed chunk ({type(exc).__name__}: {exc}): {data[:200]!r}")

    def _choice(self, choice: dict[str, Any]) -> None:
        r = self.reading
        text = (choice["delta"].get("content") or "") if self.chat else choice["text"]
        if text and r.finish is not None:
            r.problems.append("text after the finish_reason")
        r.text += text
        if choice.get("finish_reason") is not None:
            if r.finish is not None:
                r.problems.append("two finish_reasons")
            r.finish = choice["finish_reason"]

    def close(self) -> None:
        r = self.reading
        if r.stream_error is None and not r.done:
            r.problems.append("stream ended without [DONE]")
        if r.stream_error is None and r.completion_tokens is None:
            r.problems.append("no usage chunk")


class AnthropicStream:
    """message_start, content blocks opened and closed in order, one message_delta, message_stop last."""

    def __init__(self, reading: Reading) -> None:
        self.reading = reading
        self.started = False
        self.open_block: int | None = None
        self.blocks = 0
        self.start_input_tokens: int | None = None

    def feed(self, data: bytes) -> None:
        r = self.reading
        try:
            event = json.loads(data)
            kind = event["type"]
            if r.done:
                r.problems.append(f"{kind} after message_stop")
            if kind == "error":
                r.stream_error = json.dumps(event)[:BODY_KEEP_CHARS]
            elif not self.started and kind != "message_start":
                r.problems.append(f"{kind} before message_start")
            elif kind == "message_start":
                self.started = True
                start = event["message"]["usage"]  # input_tokens exclude cache reads, as in message_delta
                self.start_input_tokens = start["input_tokens"] + start.get("cache_read_input_tokens", 0)
            elif kind.startswith("content_block_"):
                self._block(kind, event)
            elif kind == "message_delta":
                self._message_delta(event)
            elif kind == "message_stop":
                r.done = True
            elif kind != "ping":
                r.problems.append(f"unknown event {kind!r}")
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            r.problems.append(f"malformed event ({type(exc).__name__}: {exc}): {data[:200]!r}")

    def _block(self, kind: str, event: dict[str, Any]) -> None:
        r, index = self.reading, event["index"]
        if kind == "content_block_start":
            if self.open_block is not None or index != self.blocks:
                r.problems.append(f"block {index} started while {self.open_block} open ({self.blocks} so far)")
            self.open_block, self.blocks = index, self.blocks + 1
            if event["content_block"]["type"] != "text":
                r.problems.append(f"unexpected block {event['content_block']['type']!r}")
        elif self.open_block != index:
            r.problems.append(f"{kind} for block {index}, open: {self.open_block}")
        elif kind == "content_block_delta":
            r.text += event["delta"]["text"]
        else:
            self.open_block = None

    def _message_delta(self, event: dict[str, Any]) -> None:
        r = self.reading
        if r.finish is not None:
            r.problems.append("two message_delta events")
        if self.open_block is not None:
            r.problems.append("message_delta with a block still open")
        r.finish, r.stop_sequence = event["delta"]["stop_reason"], event["delta"]["stop_sequence"]
        usage = event["usage"]
        r.completion_tokens = usage["output_tokens"]
        r.prompt_tokens = usage["input_tokens"] + usage.get("cache_read_input_tokens", 0)
        if self.start_input_tokens is not None and r.prompt_tokens != self.start_input_tokens:
            r.problems.append(f"message_start input + cache read {self.start_input_tokens} != final input + cache read "
                              f"{r.prompt_tokens}")

    def close(self) -> None:
        if self.reading.stream_error is None and not self.reading.done:
            self.reading.problems.append("stream ended without message_stop")


# ---- the verdict on a complete answer
def _judge(answer: Answer, reading: Reading) -> None:
    """A stream cut by the client is judged on what it read; a finished answer on everything."""
    if reading.stream_error is not None:
        answer.outcome, answer.body = "stream_error", reading.stream_error
        return
    problems = list(reading.problems)
    if answer.outcome == "ok":
        problems += answer_problems(answer.shape, reading)
    if problems:
        answer.outcome, answer.problems = "invalid", problems
        answer.body = json.dumps({"text": reading.text[:BODY_KEEP_CHARS], "finish": reading.finish,
                                  "completion_tokens": reading.completion_tokens})


def answer_problems(shape: Shape, r: Reading) -> list[str]:
    """What a finished answer got wrong against what was asked."""
    problems = []
    anthropic = shape.api == "messages"
    valid = ANTHROPIC_STOP if anthropic else OPENAI_FINISH
    if r.finish not in valid:
        problems.append(f"finish {r.finish!r} not in {valid}")
    if not isinstance(r.completion_tokens, int) or not isinstance(r.prompt_tokens, int) or r.prompt_tokens < 1:
        return problems + [f"usage counts missing or wrong: prompt {r.prompt_tokens!r}, completion {r.completion_tokens!r}"]
    if r.completion_tokens > shape.max_tokens:
        problems.append(f"completion tokens {r.completion_tokens} > max_tokens {shape.max_tokens}")
    if r.finish == ("max_tokens" if anthropic else "length") and r.completion_tokens != shape.max_tokens:
        problems.append(f"finish {r.finish} at {r.completion_tokens} tokens, max_tokens {shape.max_tokens}")
    if r.total_tokens is not None and r.total_tokens != r.prompt_tokens + r.completion_tokens:
        problems.append(f"total_tokens {r.total_tokens} != {r.prompt_tokens} + {r.completion_tokens}")
    if r.text and r.completion_tokens < 1:
        problems.append("text with 0 completion tokens")
    words = len(WORD_TOKEN.findall(r.text)) if WORD_TOKEN_TEXT.fullmatch(r.text) else 0
    if words > r.completion_tokens:
        problems.append(f"{words} tokens in the text > {r.completion_tokens} in usage")
    problems += [f"stop string {s!r} in the text" for s in shape.stop if s in r.text]
    if anthropic and (r.finish == "stop_sequence") != (r.stop_sequence is not None):
        problems.append(f"stop_reason {r.finish!r} with stop_sequence {r.stop_sequence!r}")
    if anthropic and r.stop_sequence is not None and r.stop_sequence not in shape.stop:
        problems.append(f"stop_sequence {r.stop_sequence!r} was not asked for")
    if shape.json_schema and r.finish == "stop":
        problems += json_problems(r.text)
    return problems


def json_problems(text: str) -> list[str]:
    try:
        value = json.loads(text)
    except ValueError:
        return [f"structured output is not JSON: {text[:200]!r}"]
    if not isinstance(value, dict) or set(value) != {"answer"} or value["answer"] not in ("yes", "no"):
        return [f"structured output does not fit its schema: {text[:200]!r}"]
    return []
