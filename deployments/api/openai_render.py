"""Neutral StreamChunks -> OpenAI objects: full responses and stream chunks, for chat and completions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.output.request_output import Finish, Usage
from deployments.api.openai_objects import (
    AssistantMessageOut,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    CompletionChoice,
    CompletionTokensDetails,
    CompletionLogprobs,
    FunctionCallDeltaOut,
    FunctionCallOut,
    PromptTokensDetails,
    TextCompletion,
    TokenLogprobOut,
    ToolCallDeltaOut,
    ToolCallOut,
    TopLogprobOut,
    UsageOut,
)
from deployments.output_deltas import ToolCallDelta
from engine.request import FinishReason
from deployments.api.errors import WireError
from deployments.api.sse import SSE_DONE, SSE_KEEPALIVE, sse_event, sse_events
from deployments.model_calls import StreamChunk, TokenLogprobInfo, merged


@dataclass(frozen=True)
class ResponseMeta:
    id: str
    created: int
    model: str


def usage_out(usage: Usage) -> UsageOut:
    out = UsageOut(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.cached_tokens),
    )
    if usage.accepted_draft_tokens or usage.rejected_draft_tokens:
        out.completion_tokens_details = CompletionTokensDetails(
            accepted_prediction_tokens=usage.accepted_draft_tokens,
            rejected_prediction_tokens=usage.rejected_draft_tokens,
        )
    return out


def finish_reason(finish: Finish | None, called_tools: bool = False) -> str | None:
    """OpenAI's reason; a generation that stopped after tool calls finished with "tool_calls"."""
    if finish is None:
        return None
    if called_tools and finish.reason is FinishReason.STOP:
        return "tool_calls"
    return finish.reason.value


def tool_calls_out(deltas: list[ToolCallDelta]) -> list[ToolCallOut]:
    """Whole calls from deltas (in one chunk: the coalesced output of a whole generation)."""
    calls: dict[int, ToolCallOut] = {}
    for delta in deltas:
        call = calls.get(delta.index)
        if call is None:
            calls[delta.index] = ToolCallOut(id=delta.id or "", function=FunctionCallOut(name=delta.name or "", arguments=delta.arguments))
        else:
            call.function.arguments += delta.arguments
    return [calls[i] for i in sorted(calls)]


def tool_call_deltas_out(deltas: list[ToolCallDelta]) -> list[ToolCallDeltaOut]:
    """OpenAI's stream shape: a call's first delta {index, id, type, function: {name, arguments: ""}},
    then {index, function: {arguments: fragment}}."""
    out = []
    for delta in deltas:
        if delta.id is not None:
            head = FunctionCallDeltaOut(name=delta.name or "", arguments="")
            out.append(ToolCallDeltaOut(index=delta.index, id=delta.id, type="function", function=head))
        if delta.arguments:
            out.append(ToolCallDeltaOut(index=delta.index, function=FunctionCallDeltaOut(arguments=delta.arguments)))
    return out


def chat_logprobs(infos: list[TokenLogprobInfo] | None) -> ChatLogprobs | None:
    if infos is None:
        return None
    content = [
        TokenLogprobOut(
            token=i.token,
            logprob=i.logprob,
            bytes=i.token_bytes,
            top_logprobs=[TopLogprobOut(token=t.token, logprob=t.logprob, bytes=t.token_bytes) for t in i.top_logprobs],
        )
        for i in infos
    ]
    return ChatLogprobs(content=content, refusal=None)


class _OpenAIStream:
    """OpenAI's SSE: `data:` lines, errors as an error object, `data: [DONE]` at the end, SSE comments to keep
    an idle stream alive (clients skip them)."""

    def opening_payloads(self) -> list[dict[str, Any]]:
        """What the stream starts with, once (written at admission, before any output)."""
        return []

    def stream_payloads(self, chunk: StreamChunk) -> list[dict[str, Any]]:
        raise NotImplementedError

    def sse_start(self, first: StreamChunk) -> str:
        payloads = self.opening_payloads()
        return sse_events(payloads) if payloads else ""

    def sse(self, chunk: StreamChunk) -> str:
        payloads = self.stream_payloads(chunk)
        return sse_events(payloads) if payloads else ""

    def sse_waiting(self) -> str:
        return SSE_KEEPALIVE

    def sse_keepalive(self) -> str:
        return SSE_KEEPALIVE

    def sse_error(self, error: WireError) -> str:
        return sse_event(error.body)

    def sse_end(self) -> str:
        return SSE_DONE


class ChatRenderer(_OpenAIStream):
    def __init__(self, meta: ResponseMeta, include_usage: bool = False) -> None:
        self._meta = meta
        self._include_usage = include_usage
        self._sent_role = False
        self._called_tools = False

    def completion(self, parts: list[StreamChunk]) -> dict[str, Any]:
        total = merged(parts)
        assert total.finish is not None
        calls = tool_calls_out(total.tool_calls)
        message = AssistantMessageOut(content=total.text or (None if calls else ""), refusal=None)
        if total.reasoning:
            message.reasoning_content = total.reasoning
        if calls:
            message.tool_calls = calls
        choice = ChatChoice(
            index=0,
            message=message,
            logprobs=chat_logprobs(total.logprobs),
            finish_reason=finish_reason(total.finish, bool(calls)),
        )
        meta = self._meta
        response = ChatCompletion(
            id=meta.id, created=meta.created, model=meta.model, choices=[choice], usage=usage_out(total.finish.usage)
        )
        return response.dump()

    def opening_payloads(self) -> list[dict[str, Any]]:
        """The role chunk, once."""
        if self._sent_role:
            return []
        self._sent_role = True
        return [self._chunk(ChatDelta(role="assistant", content=""), None, None)]

    def stream_payloads(self, chunk: StreamChunk) -> list[dict[str, Any]]:
        """OpenAI's order: a role chunk (if the opening did not send it), reasoning / content / tool-call chunks,
        an empty-delta finish chunk, a usage chunk."""
        payloads = self.opening_payloads()
        if chunk.reasoning:
            payloads.append(self._chunk(ChatDelta(reasoning_content=chunk.reasoning), None, None))
        if chunk.text or chunk.logprobs:
            payloads.append(self._chunk(ChatDelta(content=chunk.text), chat_logprobs(chunk.logprobs), None))
        if chunk.tool_calls:
            self._called_tools = True
            for delta in tool_call_deltas_out(chunk.tool_calls):  # one per chunk, as OpenAI streams them
                payloads.append(self._chunk(ChatDelta(tool_calls=[delta]), None, None))
        if chunk.finish is not None:
            payloads.append(self._chunk(ChatDelta(), None, finish_reason(chunk.finish, self._called_tools)))
            if self._include_usage:
                payloads.append(self._usage_chunk(chunk.finish.usage))
        return payloads

    def _chunk(self, delta: ChatDelta, logprobs: ChatLogprobs | None, reason: str | None) -> dict[str, Any]:
        choice = ChatChunkChoice(index=0, delta=delta, logprobs=logprobs, finish_reason=reason)
        meta = self._meta
        chunk = ChatCompletionChunk(id=meta.id, created=meta.created, model=meta.model, choices=[choice])
        if self._include_usage:
            chunk.usage = None  # OpenAI: every chunk but the last has "usage": null
        return chunk.dump()

    def _usage_chunk(self, usage: Usage) -> dict[str, Any]:
        meta = self._meta
        return ChatCompletionChunk(
            id=meta.id, created=meta.created, model=meta.model, choices=[], usage=usage_out(usage)
        ).dump()


class CompletionRenderer(_OpenAIStream):
    def __init__(self, meta: ResponseMeta, include_usage: bool = False) -> None:
        self._meta = meta
        self._include_usage = include_usage
        self._text_offset = 0

    def completion(self, parts: list[StreamChunk]) -> dict[str, Any]:
        total = merged(parts)
        assert total.finish is not None
        choice = CompletionChoice(
            index=0, text=total.text, logprobs=self._logprobs(total.logprobs), finish_reason=finish_reason(total.finish)
        )
        meta = self._meta
        return TextCompletion(
            id=meta.id, created=meta.created, model=meta.model, choices=[choice], usage=usage_out(total.finish.usage)
        ).dump()

    def stream_payloads(self, chunk: StreamChunk) -> list[dict[str, Any]]:
        payloads = []
        if chunk.text or chunk.logprobs or chunk.finish is not None:
            choice = CompletionChoice(
                index=0, text=chunk.text, logprobs=self._logprobs(chunk.logprobs), finish_reason=finish_reason(chunk.finish)
            )
            payloads.append(self._completion_chunk([choice]))
        if chunk.finish is not None and self._include_usage:
            payloads.append(self._completion_chunk([], usage_out(chunk.finish.usage)))
        return payloads

    def _completion_chunk(self, choices: list[CompletionChoice], usage: UsageOut | None = None) -> dict[str, Any]:
        meta = self._meta
        chunk = TextCompletion(id=meta.id, created=meta.created, model=meta.model, choices=choices)
        if self._include_usage:
            chunk.usage = usage
        return chunk.dump()

    def _logprobs(self, infos: list[TokenLogprobInfo] | None) -> CompletionLogprobs | None:
        if infos is None:
            return None
        offsets = []
        for info in infos:  # offsets continue across stream chunks
            offsets.append(self._text_offset)
            self._text_offset += len(info.token)
        return CompletionLogprobs(
            tokens=[i.token for i in infos],
            token_logprobs=[i.logprob for i in infos],
            top_logprobs=[{t.token: t.logprob for t in i.top_logprobs} for i in infos],
            text_offset=offsets,
        )
