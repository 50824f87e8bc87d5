"""One streamed chat answer over the OpenAI-compatible API: the SSE chunks' deltas to a sink, the answer and its
timings back (orchard chat's /stats)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Protocol

import httpx

from deployments.cli.server_client import error_message


class AnswerSink(Protocol):
    def reasoning(self, text: str) -> None: ...

    def text(self, text: str) -> None: ...


@dataclass
class ToolCall:
    id: str = ""
    name: str = ""
    arguments: str = ""  # JSON text as the model wrote it (unfinished if the answer was cut)


@dataclass
class AnswerStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None  # request sent -> first reasoning or text
    total_s: float = 0.0

    @property
    def tokens_per_s(self) -> float | None:
        """Decode rate: the tokens after the first over the time after the first."""
        if self.ttft_s is None or self.completion_tokens < 2 or self.total_s <= self.ttft_s:
            return None
        return (self.completion_tokens - 1) / (self.total_s - self.ttft_s)

    def describe(self) -> str:
        rate = f"{self.tokens_per_s:.1f} tok/s" if self.tokens_per_s is not None else "- tok/s"
        ttft = f"TTFT {self.ttft_s:.2f} s" if self.ttft_s is not None else "TTFT -"
        return (f"{self.completion_tokens} tokens, {rate}, {ttft}, {self.total_s:.2f} s in all; "
                f"prompt {self.prompt_tokens} tokens ({self.cached_tokens} from the prefix cache)")


@dataclass
class Answer:
    text: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str | None = None
    stats: AnswerStats = field(default_factory=AnswerStats)
    blocks: list[dict] = field(default_factory=list)  # over /v1/messages (--mcp): the content blocks, as history


class AnswerError(Exception):
    """The server refused or broke off the answer; the message is the server's."""


def stream_answer(http: httpx.Client, url: str, body: dict, sink: AnswerSink) -> Answer:
    """POST a streamed chat completion and feed its deltas to `sink` as they come."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    answer = Answer()
    started = time.perf_counter()
    with http.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            response.read()
            raise AnswerError(error_message(response))
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue  # SSE comments are keep-alives
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                raise AnswerError(chunk["error"].get("message", str(chunk["error"])))
            _take_chunk(chunk, answer, sink, started)
    answer.stats.total_s = time.perf_counter() - started
    return answer


def _take_chunk(chunk: dict, answer: Answer, sink: AnswerSink, started: float) -> None:
    usage = chunk.get("usage")
    if usage:
        answer.stats.prompt_tokens = usage.get("prompt_tokens", 0)
        answer.stats.completion_tokens = usage.get("completion_tokens", 0)
        answer.stats.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    for choice in chunk.get("choices", []):
        delta = choice.get("delta") or {}
        reasoning, text = delta.get("reasoning_content"), delta.get("content")
        if (reasoning or text or delta.get("tool_calls")) and answer.stats.ttft_s is None:
            answer.stats.ttft_s = time.perf_counter() - started
        if reasoning:
            answer.reasoning += reasoning
            sink.reasoning(reasoning)
        if text:
            answer.text += text
            sink.text(text)
        for call_delta in delta.get("tool_calls") or []:
            _take_tool_call_delta(call_delta, answer.tool_calls)
        if choice.get("finish_reason"):
            answer.finish_reason = choice["finish_reason"]


def _take_tool_call_delta(call_delta: dict, calls: list[ToolCall]) -> None:
    index = call_delta.get("index", len(calls))
    while len(calls) <= index:
        calls.append(ToolCall())
    call = calls[index]
    function = call_delta.get("function") or {}
    call.id = call_delta.get("id") or call.id
    call.name += function.get("name") or ""
    call.arguments += function.get("arguments") or ""
