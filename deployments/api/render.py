"""Neutral StreamChunks -> OpenAI objects: full responses and stream chunks, for chat and completions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.output.events import Finish, Usage
from deployments.api.responses import (
    AssistantMessageOut,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    PromptTokensDetails,
    TextCompletion,
    TokenLogprobOut,
    TopLogprobOut,
    UsageOut,
)
from deployments.protocol import StreamChunk, TokenLogprobInfo


@dataclass(frozen=True)
class ResponseMeta:
    id: str
    created: int
    model: str


def usage_out(usage: Usage) -> UsageOut:
    return UsageOut(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.cached_tokens),
    )


def finish_reason(finish: Finish | None) -> str | None:
    return finish.reason.value if finish is not None else None


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


class ChatRenderer:
    def __init__(self, meta: ResponseMeta, include_usage: bool = False) -> None:
        self._meta = meta
        self._include_usage = include_usage
        self._sent_role = False

    def completion(self, total: StreamChunk) -> dict[str, Any]:
        assert total.finish is not None
        choice = ChatChoice(
            index=0,
            message=AssistantMessageOut(content=total.text, refusal=None),
            logprobs=chat_logprobs(total.logprobs),
            finish_reason=finish_reason(total.finish),
        )
        meta = self._meta
        response = ChatCompletion(
            id=meta.id, created=meta.created, model=meta.model, choices=[choice], usage=usage_out(total.finish.usage)
        )
        return response.dump()

    def stream_payloads(self, chunk: StreamChunk) -> list[dict[str, Any]]:
        """OpenAI's order: a role chunk, content chunks, an empty-delta finish chunk, a usage chunk."""
        payloads = []
        if not self._sent_role:
            self._sent_role = True
            payloads.append(self._chunk(ChatDelta(role="assistant", content=""), None, None))
        if chunk.text or chunk.logprobs:
            payloads.append(self._chunk(ChatDelta(content=chunk.text), chat_logprobs(chunk.logprobs), None))
        if chunk.finish is not None:
            payloads.append(self._chunk(ChatDelta(), None, finish_reason(chunk.finish)))
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


class CompletionRenderer:
    def __init__(self, meta: ResponseMeta, include_usage: bool = False) -> None:
        self._meta = meta
        self._include_usage = include_usage
        self._text_offset = 0

    def completion(self, total: StreamChunk) -> dict[str, Any]:
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
