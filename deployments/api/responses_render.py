"""Neutral StreamChunks -> Responses API objects: the Response and its SSE event sequence.

One output builder turns chunks into item events (output_item.added, content_part.added, deltas, the done events);
the streamed renderer numbers and sends them, the whole response keeps the items the builder made from the one
merged chunk, so both hold the same output: reasoning, message and function_call items in the model's order.
"""

from __future__ import annotations

import copy
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from deployments.api.errors import WireError
from deployments.api.responses_schemas import ResponsesRequest
from deployments.api.sse import named_sse_events
from deployments.output_deltas import McpEvent, McpToolCall, McpToolListing, McpToolResult, ToolCallDelta
from deployments.model_calls import StreamChunk, TokenLogprobInfo, merged
from engine.output.request_output import Finish, Usage
from engine.request import FinishReason

Event = tuple[str, dict[str, Any]]  # (type, payload without type and sequence_number)


@dataclass(frozen=True)
class ResponseShell:
    """What every Response object of one request holds besides its status, output and usage."""

    id: str
    created_at: int
    model: str
    echo: dict[str, Any]  # the request's settings, echoed as OpenAI does (instructions, tools, text, ...)
    namespaces: dict[str, str] = field(default_factory=dict)  # function name -> its namespace tool's name


def response_shell(
    body: ResponsesRequest, tools: list[dict[str, Any]], response_id: str, namespaces: dict[str, str] | None = None
) -> ResponseShell:
    choice = body.tool_choice
    text = body.text
    echo = {
        "instructions": body.instructions,
        "tools": tools,
        "tool_choice": "auto" if choice is None else choice if isinstance(choice, str) else choice.model_dump(),
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "top_logprobs": body.top_logprobs or 0,
        "max_output_tokens": body.max_output_tokens,
        "max_tool_calls": body.max_tool_calls,
        "previous_response_id": body.previous_response_id,
        "reasoning": body.reasoning.model_dump() if body.reasoning else {"effort": None, "summary": None},
        "text": {
            "format": text.format.model_dump(by_alias=True) if text and text.format else {"type": "text"},
            "verbosity": (text.verbosity if text else None) or "medium",
        },
        "store": body.stores,
        "background": False,
        "metadata": body.metadata or {},
        "truncation": body.truncation or "disabled",
        "user": body.user,
        "prompt_cache_key": body.prompt_cache_key,
        "safety_identifier": body.safety_identifier,
        "service_tier": "default",
    }
    return ResponseShell(response_id, int(time.time()), body.model, echo, namespaces or {})


def response_object(shell: ResponseShell, status: str, output: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    """A Response: `fields` may set usage, error, incomplete_details, completed_at."""
    return {"id": shell.id, "object": "response", "created_at": shell.created_at, "status": status,
            "completed_at": None, "error": None, "incomplete_details": None, "model": shell.model,
            "output": output, "usage": None, **shell.echo, **fields}


def usage_object(usage: Usage) -> dict[str, Any]:
    # Reasoning tokens are not counted apart: a coalesced chunk mixes them with text (0, in both modes alike).
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.total_tokens,
    }


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class OutputBuilder:
    """Output items from chunks. The last item is open while `_open` names its kind; the events carry copies."""

    items: list[dict[str, Any]] = field(default_factory=list)
    namespaces: dict[str, str] = field(default_factory=dict)  # function name -> namespace, told in its calls
    _open: str | None = None  # "reasoning" | "message" | "function_call" | "mcp_call"

    def feed(self, chunk: StreamChunk) -> list[Event]:
        events: list[Event] = []
        if chunk.reasoning:
            events += self._ensure("reasoning")
            events.append(self._text_delta("response.reasoning_text.delta", chunk.reasoning))
        if chunk.text or chunk.logprobs:
            events += self._ensure("message")
            events.append(self._text_delta("response.output_text.delta", chunk.text, chunk.logprobs or []))
        for call in chunk.tool_calls:
            events += self._call(call)
        for event in chunk.mcp:
            events += self._mcp(event)
        return events

    def close(self, status: str = "completed") -> list[Event]:
        """The open item's done events: every streamed item ends so, as OpenAI's do."""
        if self._open is None:
            return []
        kind, item, self._open = self._open, self.items[-1], None
        item["status"] = status
        where = self._where()
        events: list[Event] = []
        if kind == "function_call":
            events.append(("response.function_call_arguments.done", {**where, "arguments": item["arguments"]}))
        elif kind == "mcp_call":  # its result never came (the answer ended or failed first)
            item["status"] = "incomplete"
        else:
            part = item["content"][0]
            done = {**where, "content_index": 0, "text": part["text"]}
            if kind == "message":
                events.append(("response.output_text.done", {**done, "logprobs": _delta_logprobs(part["logprobs"])}))
            else:
                events.append(("response.reasoning_text.done", done))
            events.append(("response.content_part.done", {**where, "content_index": 0, "part": copy.deepcopy(part)}))
        events.append(("response.output_item.done", {"output_index": len(self.items) - 1, "item": copy.deepcopy(item)}))
        return events

    def _ensure(self, kind: str) -> list[Event]:
        if self._open == kind:
            return []
        events = self.close()
        if kind == "message":
            item = {"id": _new_id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                    "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"id": _new_id("rs"), "type": "reasoning", "status": "in_progress", "summary": [], "content": []}
            part = {"type": "reasoning_text", "text": ""}
        events += self._add(kind, item)
        item["content"].append(part)
        events.append(("response.content_part.added", {**self._where(), "content_index": 0, "part": dict(part)}))
        return events

    def _add(self, kind: str, item: dict[str, Any]) -> list[Event]:
        self.items.append(item)
        self._open = kind
        return [("response.output_item.added", {"output_index": len(self.items) - 1, "item": copy.deepcopy(item)})]

    def _text_delta(self, event: str, text: str, logprobs: list[TokenLogprobInfo] | None = None) -> Event:
        part = self.items[-1]["content"][0]
        part["text"] += text
        payload = {**self._where(), "content_index": 0, "delta": text}
        if logprobs is not None:  # output text only
            part["logprobs"] += [_part_logprob(info) for info in logprobs]
            payload["logprobs"] = _delta_logprobs([_part_logprob(info) for info in logprobs])
        return event, payload

    def _call(self, call: ToolCallDelta) -> list[Event]:
        events: list[Event] = []
        if call.id is not None or self._open != "function_call":  # a call's first delta carries its id and name
            events += self.close()
            call_id = call.id or _new_id("call")
            item = {"id": "fc_" + call_id.removeprefix("call_"), "type": "function_call", "status": "in_progress",
                    "arguments": "", "call_id": call_id, "name": call.name or ""}
            if call.name in self.namespaces:
                item["namespace"] = self.namespaces[call.name]
            events += self._add("function_call", item)
        if call.arguments:
            self.items[-1]["arguments"] += call.arguments
            events.append(("response.function_call_arguments.delta", {**self._where(), "delta": call.arguments}))
        return events

    def _mcp(self, event: McpEvent) -> list[Event]:
        """The MCP loop's items: mcp_list_tools, mcp_call (open from its arguments to its result), and
        mcp_approval_request, with their events as OpenAI names them."""
        if isinstance(event, McpToolResult):
            return self._mcp_result(event)
        events = self.close()
        if isinstance(event, McpToolListing):
            item = {"id": _new_id("mcpl"), "type": "mcp_list_tools", "server_label": event.server, "tools": []}
            events += self._add("mcp_list_tools", item)
            events.append(("response.mcp_list_tools.in_progress", self._where()))
            item["tools"] = copy.deepcopy(event.tools)
            events.append(("response.mcp_list_tools.completed", self._where()))
            return events + self._done()
        if isinstance(event, McpToolCall) and event.needs_approval:
            item = {"id": event.id, "type": "mcp_approval_request", "server_label": event.server,
                    "name": event.name, "arguments": event.arguments}
            return events + self._add("mcp_approval_request", item) + self._done()
        if isinstance(event, McpToolCall):
            item = {"id": event.id, "type": "mcp_call", "status": "in_progress", "server_label": event.server,
                    "name": event.name, "arguments": "", "approval_request_id": event.approval_request_id,
                    "output": None, "error": None}
            events += self._add("mcp_call", item)
            events.append(("response.mcp_call.in_progress", self._where()))
            item["arguments"] = event.arguments
            events.append(("response.mcp_call_arguments.delta", {**self._where(), "delta": event.arguments}))
            events.append(("response.mcp_call_arguments.done", {**self._where(), "arguments": event.arguments}))
            self._open = "mcp_call"
            return events
        return events

    def _mcp_result(self, result: McpToolResult) -> list[Event]:
        item = next((i for i in reversed(self.items) if i["type"] == "mcp_call" and i["id"] == result.call_id), None)
        if item is None:
            return []
        if item is self.items[-1] and self._open == "mcp_call":
            self._open = None
        item["status"] = "completed" if result.error is None else "failed"
        if result.error is None:
            item["output"] = result.output
        else:
            item["error"] = mcp_call_error(result)
        where = {"item_id": item["id"], "output_index": self.items.index(item)}
        return [(f"response.mcp_call.{item['status']}", where),
                ("response.output_item.done", {"output_index": where["output_index"], "item": copy.deepcopy(item)})]

    def _done(self) -> list[Event]:
        """An item added whole: done at once."""
        self._open = None
        return [("response.output_item.done", {"output_index": len(self.items) - 1,
                                               "item": copy.deepcopy(self.items[-1])})]

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}


def mcp_call_error(result: McpToolResult) -> dict[str, Any]:
    """OpenAI's McpToolCallError for a failed call."""
    if result.error_kind == "execution":
        return {"type": "mcp_tool_execution_error", "content": [{"type": "text", "text": result.error}]}
    kind = "mcp_protocol_error" if result.error_kind == "protocol" else "http_error"
    return {"type": kind, "code": result.error_code or 0, "message": result.error}


def _part_logprob(info: TokenLogprobInfo) -> dict[str, Any]:
    return {"token": info.token, "bytes": info.token_bytes, "logprob": info.logprob,
            "top_logprobs": [{"token": t.token, "bytes": t.token_bytes, "logprob": t.logprob}
                             for t in info.top_logprobs]}


def _delta_logprobs(part_logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events' shape of logprobs: the output_text part's without the bytes."""
    return [{"token": p["token"], "logprob": p["logprob"],
             "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in p["top_logprobs"]]}
            for p in part_logprobs]


def _failure(error: WireError) -> dict[str, Any]:
    """A ResponseError: OpenAI's codes, context_length_exceeded as Codex reads it."""
    detail = error.body["error"]
    if error.status == 429:
        code = "rate_limit_exceeded"
    elif detail.get("code") == "context_length_exceeded":
        code = "context_length_exceeded"
    else:
        code = "invalid_prompt" if error.status == 400 else "server_error"
    return {"code": code, "message": detail["message"]}


class ResponsesRenderer:
    """The ingress's renderer interface (completion / sse_start / sse / sse_keepalive / sse_error / sse_end) for
    /v1/responses. `on_final` receives the finished Response (completed or incomplete): the route stores it there."""

    def __init__(self, shell: ResponseShell, on_final: Callable[[dict[str, Any]], None] | None = None) -> None:
        self._shell = shell
        self._on_final = on_final
        self._builder = OutputBuilder(namespaces=self._shell.namespaces)
        self._sequence = 0
        self._created = False  # response.created sent (at admission, or while queued)
        self._started = False  # response.in_progress sent

    def completion(self, parts: list[StreamChunk]) -> dict[str, Any]:
        total = merged(parts)
        assert total.finish is not None
        builder = OutputBuilder(namespaces=self._shell.namespaces)
        for part in parts:
            builder.feed(part)
        builder.close(_item_status(total.finish))
        return self._final(total.finish, builder.items)

    def sse_start(self, first: StreamChunk) -> str:
        """response.created and response.in_progress, once: what a stream opens with (at admission, where the
        ingress opens streams before any output)."""
        return self._frame(self._start())

    def sse(self, chunk: StreamChunk) -> str:
        events = self._start() + self._builder.feed(chunk)
        if chunk.finish is not None:
            events += self._builder.close(_item_status(chunk.finish))
            response = self._final(chunk.finish, self._builder.items)
            events.append((f"response.{response['status']}", {"response": response}))
        return self._frame(events)

    def sse_error(self, error: WireError) -> str:
        """A failure after the stream started: response.failed, the output so far as it stands."""
        failed = response_object(self._shell, "failed", copy.deepcopy(self._builder.items), error=_failure(error))
        return self._frame(self._start() + [("response.failed", {"response": failed})])

    def sse_waiting(self) -> str:
        """While the request waits in the engine's queue: response.created (status queued) once, then
        response.queued. Events, not SSE comments: Codex's idle timeout (300 s) counts events."""
        response = response_object(self._shell, "queued", [])
        events: list[Event] = [] if self._created else [("response.created", {"response": response})]
        self._created = True
        return self._frame(events + [("response.queued", {"response": response})])

    def sse_keepalive(self) -> str:
        """response.in_progress with the output so far: an event that clients' idle timers count."""
        response = response_object(self._shell, "in_progress", copy.deepcopy(self._builder.items))
        return self._frame(self._start() + [("response.in_progress", {"response": response})])

    def sse_end(self) -> str:
        return ""  # Responses streams end with their last event, no [DONE]

    def _start(self) -> list[Event]:
        if self._started:
            return []
        self._started = True
        response = response_object(self._shell, "in_progress", [])
        created = [] if self._created else [("response.created", {"response": response})]
        self._created = True
        return created + [("response.in_progress", {"response": response})]

    def _final(self, finish: Finish, output: list[dict[str, Any]]) -> dict[str, Any]:
        if finish.reason is FinishReason.LENGTH:
            status, fields = "incomplete", {"incomplete_details": {"reason": "max_output_tokens"}}
        else:
            status, fields = "completed", {"completed_at": int(time.time())}
        response = response_object(self._shell, status, output, usage=usage_object(finish.usage), **fields)
        if self._on_final is not None:
            self._on_final(response)
        return response

    def _frame(self, events: list[Event]) -> str:
        numbered = []
        for kind, payload in events:
            numbered.append((kind, {"type": kind, "sequence_number": self._sequence, **payload}))
            self._sequence += 1
        return named_sse_events(numbered)


def _item_status(finish: Finish) -> str:
    return "incomplete" if finish.reason is FinishReason.LENGTH else "completed"
