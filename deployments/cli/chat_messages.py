"""One streamed answer over the Anthropic Messages API, for `orchard chat --mcp NAME`: the server runs the MCP tool
loop, and its mcp_tool_use / mcp_tool_result blocks are shown as they come, between the model's text."""

from __future__ import annotations

import json
import time
from typing import Any, Protocol

import httpx

from deployments.cli.chat_stream import Answer, AnswerError
from deployments.cli.server_client import error_message


class McpAnswerSink(Protocol):
    def reasoning(self, text: str) -> None: ...

    def text(self, text: str) -> None: ...

    def tool_call(self, server: str, name: str, arguments: str) -> None: ...

    def tool_result(self, text: str, is_error: bool) -> None: ...


def stream_mcp_answer(http: httpx.Client, url: str, body: dict, sink: McpAnswerSink) -> Answer:
    """POST a streamed /v1/messages request; `answer.blocks` holds the assistant's content blocks (its history)."""
    answer = Answer()
    started = time.perf_counter()
    with http.stream("POST", f"{url}/v1/messages", json={**body, "stream": True},
                     headers={"anthropic-beta": "mcp-client-2025-04-04"}) as response:
        if response.status_code != 200:
            response.read()
            raise AnswerError(error_message(response))
        for line in response.iter_lines():
            if line.startswith("data: "):
                _take_event(json.loads(line[len("data: "):]), answer, sink, started)
    answer.stats.total_s = time.perf_counter() - started
    return answer


def _take_event(event: dict[str, Any], answer: Answer, sink: McpAnswerSink, started: float) -> None:
    kind = event.get("type")
    if kind == "error":
        raise AnswerError(event.get("error", {}).get("message", str(event)))
    if kind == "message_start":
        usage = event["message"].get("usage") or {}
        answer.stats.cached_tokens = usage.get("cache_read_input_tokens", 0)
        answer.stats.prompt_tokens = usage.get("input_tokens", 0) + answer.stats.cached_tokens
    elif kind == "content_block_start":
        answer.blocks.append(dict(event["content_block"]))
        if answer.blocks[-1]["type"] == "mcp_tool_result":
            result = answer.blocks[-1]
            sink.tool_result("".join(part.get("text", "") for part in result.get("content") or []),
                             bool(result.get("is_error")))
    elif kind == "content_block_delta":
        _take_delta(event["delta"], answer, sink, started)
    elif kind == "content_block_stop" and answer.blocks and answer.blocks[-1]["type"] == "mcp_tool_use":
        block = answer.blocks[-1]
        arguments = block.pop("_json", "") or "{}"
        block["input"] = json.loads(arguments)
        sink.tool_call(block.get("server_name", ""), block.get("name", ""), arguments)
    elif kind == "message_delta":
        usage = event.get("usage") or {}
        answer.stats.completion_tokens = usage.get("output_tokens", 0)
        answer.stats.cached_tokens = usage.get("cache_read_input_tokens", answer.stats.cached_tokens)
        answer.stats.prompt_tokens = usage.get("input_tokens", 0) + answer.stats.cached_tokens
        answer.finish_reason = (event.get("delta") or {}).get("stop_reason")


def _take_delta(delta: dict[str, Any], answer: Answer, sink: McpAnswerSink, started: float) -> None:
    block = answer.blocks[-1]
    if delta["type"] in ("text_delta", "thinking_delta") and answer.stats.ttft_s is None:
        answer.stats.ttft_s = time.perf_counter() - started
    if delta["type"] == "text_delta":
        block["text"] = block.get("text", "") + delta["text"]
        answer.text += delta["text"]
        sink.text(delta["text"])
    elif delta["type"] == "thinking_delta":
        block["thinking"] = block.get("thinking", "") + delta["thinking"]
        answer.reasoning += delta["thinking"]
        sink.reasoning(delta["thinking"])
    elif delta["type"] == "input_json_delta":
        block["_json"] = block.get("_json", "") + delta["partial_json"]
