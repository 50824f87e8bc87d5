"""The MCP tool loop: a model's answer whose calls on MCP tools the ingress runs, feeding each result back to the
model in a next turn, until it answers without calling one.

It is a chunk source like a model's client: the route answers from it as from the model, and one stream carries every
turn (text, then the calls and their results as MCP events, then the next turn's text). Each turn is one engine
request whose prompt extends the last one's, so the prefix cache serves the earlier turns. Bounded: tool rounds
(mcp.max_rounds: calls past them are not run and the answer pauses), each call's time and result size. Closing the
stream (the client went away) cancels the turn or the calls under way; the SDK tells the server to cancel them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Protocol

from deployments.api.openai_convert import template_arguments
from deployments.mcp.hub import McpHub, OfferedTool, Toolset
from deployments.mcp_calls import McpUse, PendingMcpCall
from deployments.mcp_config import McpConfig
from deployments.model_calls import ChatPrompt, GenerateJob, StreamChunk
from deployments.output_deltas import McpEvent, McpToolCall, McpToolResult, ToolCallDelta
from engine.output.request_output import Finish, Usage
from engine.errors import InvalidRequestError
from engine.request import FinishReason

logger = logging.getLogger("ray.serve.orchard")


class ChunkSource(Protocol):
    def generate(self, job: GenerateJob) -> AsyncIterator[StreamChunk]: ...


@dataclass
class _Turn:
    """One model turn as it streams: what it wrote, and its calls on MCP tools (held back from the client's
    tool calls: the loop runs them)."""

    text: str = ""
    reasoning: str = ""
    calls: dict[int, ToolCallDelta] = field(default_factory=dict)  # MCP calls by the model's call index
    client_calls: bool = False  # the model also called one of the request's own tools
    continues: bool = False  # its calls ran and their results go to a next turn


@dataclass
class _Tally:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    calls_run: int = 0

    def add(self, usage: Usage) -> None:
        self.prompt_tokens += usage.prompt_tokens
        self.cached_tokens += usage.cached_tokens
        self.completion_tokens += usage.completion_tokens

    def usage(self) -> Usage:
        return Usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens)


class McpToolLoop:
    def __init__(self, model: ChunkSource, toolset: Toolset, use: McpUse, config: McpConfig) -> None:
        self._model = model
        self._toolset = toolset
        self._use = use
        self._config = config

    async def generate(self, job: GenerateJob) -> AsyncIterator[StreamChunk]:
        tally = _Tally()
        messages = list(_chat(job).messages)
        opening: list[McpEvent] = list(self._toolset.listings)
        try:
            if self._use.pending:
                opening += await self._run_pending(messages, tally)
            for turn_number in range(self._config.max_rounds + 1):
                turn = _Turn()
                async for chunk in self._model.generate(self._turn_job(job, messages, turn_number, tally)):
                    if chunk.is_admission_only:
                        if turn_number == 0:  # the answer's admission; a later turn's is the loop's business
                            yield chunk
                        continue
                    if opening:  # the listings and approved calls come first, once the model took the request
                        yield StreamChunk(mcp=opening)
                        opening = []
                    chunk = self._hold_back_calls(replace(chunk), turn)  # a copy: the model's chunk stays its own
                    if chunk.is_last:
                        async for out in self._end_of_turn(chunk, turn, turn_number, messages, tally):
                            yield out
                    else:
                        yield _later_turn(chunk, turn_number)
                if not turn.continues:
                    return
        finally:
            await self._toolset.aclose()

    def _turn_job(self, job: GenerateJob, messages: list[dict[str, Any]], turn: int, tally: _Tally) -> GenerateJob:
        prompt = _chat(job)
        tools = (prompt.tools or []) + self._toolset.definitions()
        mode, name = prompt.tool_choice, prompt.tool_name
        # A forced choice holds while the request's budget of calls lasts (none given: until a call ran).
        budget = self._use.max_tool_calls if self._use.max_tool_calls is not None else 1
        if mode in ("required", "function") and tally.calls_run >= budget:
            mode, name = "auto", None
        if name is None and mode == "required" and self._use.forced_server is not None:
            mode, name = _forced_on_server(self._toolset, self._use.forced_server)
        turn_prompt = replace(prompt, messages=list(messages), tools=tools or None, tool_choice=mode, tool_name=name)
        request_id = job.request_id if turn == 0 else f"{job.request_id}-turn{turn}"
        return replace(job, request_id=request_id, prompt=turn_prompt)

    def _hold_back_calls(self, chunk: StreamChunk, turn: _Turn) -> StreamChunk:
        """The chunk without its calls on MCP tools (kept in `turn`); the client's own calls go on."""
        turn.text += chunk.text
        turn.reasoning += chunk.reasoning
        passed = []
        for delta in chunk.tool_calls:
            held = turn.calls.get(delta.index)
            if held is not None:
                turn.calls[delta.index] = held.joined(delta)
            elif delta.name in self._toolset.tools and delta.id is not None:
                turn.calls[delta.index] = delta
            else:
                turn.client_calls = True
                passed.append(delta)
        chunk.tool_calls = passed
        return chunk

    async def _end_of_turn(self, last: StreamChunk, turn: _Turn, turn_number: int, messages: list[dict[str, Any]],
                           tally: _Tally) -> AsyncIterator[StreamChunk]:
        """The turn's last chunk: its usage joins the tally; its MCP calls run (or are refused past the bounds), and
        the loop goes on (`turn.continues`) unless nothing is left to run."""
        if last.error is not None or last.finish is None:
            yield last
            return
        tally.add(last.finish.usage)
        _log_turn(last, turn_number)
        calls = [c for c in turn.calls.values() if not c.unfinished]
        if last.finish.reason not in (FinishReason.STOP,) or not calls:
            yield _final(last, tally)
            return
        budget = self._use.max_tool_calls
        if budget is not None:
            calls = calls[:max(0, budget - tally.calls_run)]  # past the request's budget: not run (OpenAI's rule)
            if not calls:
                yield _final(last, tally)
                return
        events = [self._call_event(call) for call in calls]
        if turn_number >= self._config.max_rounds:
            yield _final(_with_mcp(last, events + [_not_run(e, self._config.max_rounds) for e in events]), tally,
                         paused=True)
            return
        waiting = [e for e in events if e.needs_approval]
        runnable = [e for e in events if not e.needs_approval]
        finish = last.finish
        yield _later_turn(_with_mcp(last, events), turn_number)  # the turn's text, then its calls
        results = await self._run(runnable)
        tally.calls_run += len(runnable)
        if waiting or turn.client_calls:  # the client answers next: approvals, or its own tools' results
            yield _final(StreamChunk(mcp=list(results), finish=finish), tally)
            return
        messages.append(_assistant_turn(turn, runnable))
        messages += [_tool_message(e, r) for e, r in zip(runnable, results)]
        turn.continues = True
        yield _later_turn(_with_mcp(StreamChunk(), results), turn_number)

    def _call_event(self, call: ToolCallDelta) -> McpToolCall:
        tool = self._toolset.tools[call.name or ""]
        prefix = "mcpr" if tool.needs_approval else ("mcptoolu" if self._use.api == "anthropic" else "mcp")
        return McpToolCall(f"{prefix}_{uuid.uuid4().hex}", tool.server, tool.name, call.arguments or "{}",
                           needs_approval=tool.needs_approval)

    async def _run(self, events: list[McpToolCall]) -> list[McpToolResult]:
        """The calls, at once (each within its own limits); the results in the calls' order."""
        return list(await asyncio.gather(*(self._run_one(e) for e in events)))

    async def _run_one(self, event: McpToolCall) -> McpToolResult:
        tool: OfferedTool = self._toolset.tools[event.name]
        arguments = _arguments(event.arguments)
        if arguments is None:
            return McpToolResult(event.id, error=f"the arguments of the call on '{event.name}' are not a JSON object: "
                                 f"{event.arguments[:200]}", error_kind="execution")
        return await tool.session.call(event.id, event.name, arguments, tool.timeout_s, self._config.max_result_bytes)

    async def _run_pending(self, messages: list[dict[str, Any]], tally: _Tally) -> list[McpEvent]:
        """Calls the client answered an approval request for: run if approved, told the model if declined."""
        events: list[McpEvent] = []
        approved: list[tuple[McpToolCall, PendingMcpCall]] = []
        for pending in self._use.pending:
            if pending.name not in self._toolset.tools:
                continue  # the tool is no longer offered: nothing to run
            call = McpToolCall(f"mcp_{uuid.uuid4().hex}", pending.server, pending.name, pending.arguments,
                               approval_request_id=pending.approval_request_id)
            if pending.approve:
                approved.append((call, pending))
            else:
                declined = McpToolResult(call.id, error="the user declined this call" + (
                    f": {pending.reason}" if pending.reason else ""))
                messages += [_assistant_turn(_Turn(), [call]), _tool_message(call, declined)]
        results = await self._run([call for call, _ in approved])
        tally.calls_run += len(approved)
        for (call, _), result in zip(approved, results):
            events += [call, result]
            messages += [_assistant_turn(_Turn(), [call]), _tool_message(call, result)]
        return events


async def tool_loop_client(hub: McpHub, use: McpUse, job: GenerateJob, model: ChunkSource) -> McpToolLoop:
    """The loop over `model` for a request that uses MCP servers: their tools listed (a 400 or 424 if a server is
    not allowed or cannot be reached), and a tool_choice naming one checked against them."""
    prompt = _chat(job)
    own = {tool["function"]["name"] for tool in prompt.tools or ()}
    toolset = await hub.toolset(use, own)
    if prompt.tool_name is not None and prompt.tool_name not in own | set(toolset.tools):
        await toolset.aclose()
        raise InvalidRequestError(f"tool_choice names the tool '{prompt.tool_name}', which neither 'tools' nor the "
                                  "MCP servers offer", param="tool_choice.name")
    return McpToolLoop(model, toolset, use, hub.config)


def _chat(job: GenerateJob) -> ChatPrompt:
    assert isinstance(job.prompt, ChatPrompt), "the tool loop answers chat prompts"
    return job.prompt


def _forced_on_server(toolset: Toolset, server: str) -> tuple[str, str | None]:
    """OpenAI's tool_choice {"type": "mcp", "server_label"} without a name: the server's one tool, else any."""
    names = [t.name for t in toolset.tools.values() if t.server == server]
    return ("function", names[0]) if len(names) == 1 else ("required", None)


def _later_turn(chunk: StreamChunk, turn_number: int) -> StreamChunk:
    """A chunk of the answer that is not its last: a turn's finish and admission are the loop's business."""
    chunk.finish = None
    if turn_number:
        chunk.prompt_tokens = chunk.cached_tokens = None
        chunk.queued = chunk.admitted = False
    return chunk


def _final(last: StreamChunk, tally: _Tally, paused: bool = False) -> StreamChunk:
    assert last.finish is not None
    last.finish = Finish(last.finish.reason, tally.usage(), last.finish.stop_reason)
    last.tool_loop_paused = paused
    return last


def _with_mcp(chunk: StreamChunk, events: list[Any]) -> StreamChunk:
    chunk.mcp = chunk.mcp + events
    return chunk


def _not_run(call: McpToolCall, rounds: int) -> McpToolResult:
    return McpToolResult(call.id, error=f"not run: this answer reached the tool loop's limit of {rounds} tool rounds "
                         "(the ingress's mcp.max_rounds); send the conversation again to go on",
                         error_kind="protocol", error_code=-32000)


def _arguments(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text or "{}")
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _assistant_turn(turn: _Turn, calls: list[McpToolCall]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": turn.text}
    if turn.reasoning:
        message["reasoning_content"] = turn.reasoning
    message["tool_calls"] = [{"id": call.id, "type": "function",
                              "function": {"name": call.name, "arguments": template_arguments(call.arguments)}}
                             for call in calls]
    return message


def _tool_message(call: McpToolCall, result: McpToolResult) -> dict[str, Any]:
    content = result.output if result.error is None else f"Error: {result.error}"
    return {"role": "tool", "tool_call_id": call.id, "name": call.name, "content": content}


def _log_turn(last: StreamChunk, turn_number: int) -> None:
    usage = last.finish.usage if last.finish is not None else None
    if usage is not None:
        logger.info("tool loop turn %d: %d prompt tokens, %d from the prefix cache", turn_number,
                    usage.prompt_tokens, usage.cached_tokens)
