"""Neutral StreamChunks -> Anthropic Messages responses and their SSE event sequence.

One block builder turns chunks into block operations (open / delta / close); the streamed
renderer writes them as events, the whole response applies them to a content list, so both
hold the same blocks: thinking, text and tool_use, in the order the model wrote them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from engine.output.request_output import Finish, Usage
from deployments.output_deltas import McpEvent, McpToolCall, McpToolResult, ToolCallDelta
from engine.request import FinishReason
from deployments.api.errors import WireError, as_anthropic
from deployments.api.sse import SSE_KEEPALIVE, named_sse_events
from deployments.model_calls import StreamChunk, merged


@dataclass(frozen=True)
class MessageMeta:
    id: str
    model: str


@dataclass
class BlockOp:
    """Open a block (`block` is its start shape), add `delta` to block `index`, or close it."""

    kind: str  # "start" | "delta" | "stop"
    index: int
    block: dict[str, Any] | None = None
    delta: dict[str, Any] | None = None


def tool_use_id(call_id: str | None) -> str:
    return "toolu_" + (call_id or "").removeprefix("call_")


def _tool_input_json(arguments: str) -> str:
    """Anthropic's tool input is a JSON object: invalid model output is kept under one key."""
    try:
        if isinstance(json.loads(arguments), dict):
            return arguments
    except ValueError:
        pass
    return json.dumps({"_raw_arguments": arguments}, ensure_ascii=False)


@dataclass
class BlockBuilder:
    _open: tuple[str, int | None] | None = None  # ("thinking" | "text" | "tool_use", tool index)
    _count: int = 0
    called_tools: bool = False
    _unfinished_calls: set[int] = field(default_factory=set)  # tool indexes left out

    def ops(self, chunk: StreamChunk) -> list[BlockOp]:
        ops: list[BlockOp] = []
        if chunk.reasoning:
            ops += self._ensure(("thinking", None), {"type": "thinking", "thinking": "", "signature": ""})
            ops.append(BlockOp("delta", self._count - 1, delta={"type": "thinking_delta", "thinking": chunk.reasoning}))
        if chunk.text:
            ops += self._ensure(("text", None), {"type": "text", "text": ""})
            ops.append(BlockOp("delta", self._count - 1, delta={"type": "text_delta", "text": chunk.text}))
        for call in chunk.tool_calls:
            ops += self._tool_ops(call)
        for event in chunk.mcp:
            ops += self._mcp_ops(event)
        return ops

    def close(self) -> list[BlockOp]:
        if self._open is None:
            return []
        self._open = None
        return [BlockOp("stop", self._count - 1)]

    def _ensure(self, kind: tuple[str, int | None], block: dict[str, Any]) -> list[BlockOp]:
        if self._open == kind:
            return []
        ops = self.close()
        self._open = kind
        self._count += 1
        return ops + [BlockOp("start", self._count - 1, block=block)]

    def _tool_ops(self, call: ToolCallDelta) -> list[BlockOp]:
        # A call cut by max_tokens is left out (stop_reason "max_tokens" says why): its input would be half an
        # object that matches no schema, and a client must not run a half-written command or file.
        if call.unfinished:
            self._unfinished_calls.add(call.index)
        if call.index in self._unfinished_calls:
            return []
        self.called_tools = True
        arguments = call.arguments
        ops: list[BlockOp] = []
        if call.id is not None:  # a new call: its own block
            start = {"type": "tool_use", "id": tool_use_id(call.id), "name": call.name or "", "input": {}}
            ops += self.close() + self._ensure(("tool_use", call.index), start)
            ops.append(BlockOp("delta", self._count - 1, delta={"type": "input_json_delta", "partial_json": ""}))
            arguments = _tool_input_json(arguments)  # our parsers send a call's arguments whole
        if arguments:
            ops.append(BlockOp("delta", self._count - 1, delta={"type": "input_json_delta", "partial_json": arguments}))
        return ops


    def _mcp_ops(self, event: McpEvent) -> list[BlockOp]:
        """The MCP connector's blocks: mcp_tool_use (its input as one delta, as a tool_use's), mcp_tool_result
        (whole in its start: it has no delta type). Listings are OpenAI's only."""
        if isinstance(event, McpToolCall):
            start = {"type": "mcp_tool_use", "id": event.id, "name": event.name, "server_name": event.server,
                     "input": {}}
            ops = self.close() + self._ensure(("mcp_tool_use", None), start)
            delta = {"type": "input_json_delta", "partial_json": _tool_input_json(event.arguments)}
            return ops + [BlockOp("delta", self._count - 1, delta=delta)] + self.close()
        if isinstance(event, McpToolResult):
            text = event.output if event.error is None else event.error
            block = {"type": "mcp_tool_result", "tool_use_id": event.call_id, "is_error": event.error is not None,
                     "content": [{"type": "text", "text": text}]}
            return self.close() + self._ensure(("mcp_tool_result", None), block) + self.close()
        return []


def stop_reason(finish: Finish, called_tools: bool, paused: bool = False) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) as Anthropic names them; `paused`: the MCP tool loop stopped at its bound."""
    if paused:
        return "pause_turn", None
    if finish.reason is FinishReason.LENGTH:
        return "max_tokens", None
    if called_tools:
        return "tool_use", None
    if isinstance(finish.stop_reason, str):
        return "stop_sequence", finish.stop_reason
    return "end_turn", None


def usage_dict(usage: Usage) -> dict[str, int]:
    """Anthropic counts cache reads apart: input_tokens are the prompt tokens not read from cache."""
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": usage.cached_tokens,
        "output_tokens": usage.completion_tokens,
    }


def _message_shell(meta: MessageMeta) -> dict[str, Any]:
    return {"id": meta.id, "type": "message", "role": "assistant", "model": meta.model, "content": []}


def message_response(meta: MessageMeta, parts: list[StreamChunk]) -> dict[str, Any]:
    """The whole message from the answer's chunks, in order: the same blocks its stream would hold."""
    total = merged(parts)
    assert total.finish is not None
    builder = BlockBuilder()
    content: list[dict[str, Any]] = []
    ops = [op for part in parts for op in builder.ops(part)]
    for op in ops + builder.close():
        if op.kind == "start":
            content.append(dict(op.block or {}))
        elif op.kind == "delta":
            _apply_delta(content[op.index], op.delta or {})
    for block in content:
        if block["type"] in ("tool_use", "mcp_tool_use"):
            block["input"] = json.loads(block.pop("_json", "") or "{}")
    reason, sequence = stop_reason(total.finish, builder.called_tools, total.tool_loop_paused)
    return {**_message_shell(meta), "content": content, "stop_reason": reason, "stop_sequence": sequence,
            "usage": usage_dict(total.finish.usage)}


def _apply_delta(block: dict[str, Any], delta: dict[str, Any]) -> None:
    if delta["type"] == "text_delta":
        block["text"] += delta["text"]
    elif delta["type"] == "thinking_delta":
        block["thinking"] += delta["thinking"]
    else:
        block["_json"] = block.get("_json", "") + delta["partial_json"]


PING = ("ping", {"type": "ping"})


@dataclass
class MessageStreamRenderer:
    meta: MessageMeta
    _builder: BlockBuilder = field(default_factory=BlockBuilder)
    _started: bool = False

    def start(self, first: StreamChunk) -> list[tuple[str, dict[str, Any]]]:
        """message_start (once), from the stream's first chunk: its admission, with the prompt's cache split."""
        if self._started:
            return []
        self._started = True
        # The same split as message_delta's usage (the engine's Finish): input_tokens exclude cache reads.
        usage = usage_dict(Usage(first.prompt_tokens or 0, 0, first.cached_tokens or 0))
        message = {**_message_shell(self.meta), "stop_reason": None, "stop_sequence": None, "usage": usage}
        return [("message_start", {"type": "message_start", "message": message}), PING]

    def events(self, chunk: StreamChunk) -> list[tuple[str, dict[str, Any]]]:
        """(event name, payload) pairs for this chunk, in Anthropic's order (message_start first, if not sent)."""
        events = self.start(chunk)
        for op in self._builder.ops(chunk):
            events.append(_op_event(op))
        if chunk.finish is not None:
            events += [_op_event(op) for op in self._builder.close()]
            reason, sequence = stop_reason(chunk.finish, self._builder.called_tools, chunk.tool_loop_paused)
            delta = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                     "usage": usage_dict(chunk.finish.usage)}
            events += [("message_delta", delta), ("message_stop", {"type": "message_stop"})]
        return events


def _op_event(op: BlockOp) -> tuple[str, dict[str, Any]]:
    if op.kind == "start":
        return "content_block_start", {"type": "content_block_start", "index": op.index, "content_block": op.block}
    if op.kind == "delta":
        return "content_block_delta", {"type": "content_block_delta", "index": op.index, "delta": op.delta}
    return "content_block_stop", {"type": "content_block_stop", "index": op.index}


class MessagesRenderer:
    """The ingress's renderer interface (ingress/routes.py's Renderer) for /v1/messages."""

    def __init__(self, meta: MessageMeta) -> None:
        self._meta = meta
        self._stream = MessageStreamRenderer(meta)

    def completion(self, parts: list[StreamChunk]) -> dict[str, Any]:
        return message_response(self._meta, parts)

    def sse_start(self, first: StreamChunk) -> str:
        return named_sse_events(self._stream.start(first))

    def sse(self, chunk: StreamChunk) -> str:
        return named_sse_events(self._stream.events(chunk))

    def sse_waiting(self) -> str:
        return SSE_KEEPALIVE  # a comment: no event comes before message_start, which needs the admission

    def sse_keepalive(self) -> str:
        return named_sse_events([PING])

    def sse_error(self, error: WireError) -> str:
        return named_sse_events([("error", as_anthropic(error).body)])

    def sse_end(self) -> str:
        return ""
