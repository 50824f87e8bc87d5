"""OpenAI response objects as pydantic models.

A field is written when it holds a value or the renderer set it explicitly (even to None):
that is how OpenAI's shapes differ, e.g. `usage: null` only in chunks of include_usage streams.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel


class _Out(BaseModel):
    def model_post_init(self, context: Any) -> None:
        # Defaults that hold a value (object="chat.completion", ...) count as set; None defaults do not.
        for name in type(self).model_fields:
            if getattr(self, name) is not None:
                self.__pydantic_fields_set__.add(name)

    def dump(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_unset=True)


class PromptTokensDetails(_Out):
    cached_tokens: int


class CompletionTokensDetails(_Out):
    """OpenAI's Predicted Outputs counts; here the draft tokens speculative decoding verified."""

    accepted_prediction_tokens: int
    rejected_prediction_tokens: int


class UsageOut(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    # Only for a request that verified draft tokens (a model that speculates, the request not opted out).
    completion_tokens_details: CompletionTokensDetails | None = None


class TopLogprobOut(_Out):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobOut(_Out):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprobOut]


class ChatLogprobs(_Out):
    content: list[TokenLogprobOut] | None
    refusal: list[TokenLogprobOut] | None = None


class CompletionLogprobs(_Out):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class FunctionCallOut(_Out):
    name: str
    arguments: str


class ToolCallOut(_Out):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessageOut(_Out):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None
    reasoning_content: str | None = None  # vLLM's / DeepSeek's field for reasoning text
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(_Out):
    index: int
    message: AssistantMessageOut
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletion(_Out):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageOut
    system_fingerprint: str | None = None


class FunctionCallDeltaOut(_Out):
    name: str | None = None
    arguments: str | None = None


class ToolCallDeltaOut(_Out):
    """OpenAI's streamed tool call: the first delta of a call has id, type and name; later ones
    only index and argument fragments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDeltaOut


class ChatDelta(_Out):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDeltaOut] | None = None


class ChatChunkChoice(_Out):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionChunk(_Out):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageOut | None = None
    system_fingerprint: str | None = None


class CompletionChoice(_Out):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class TextCompletion(_Out):
    """Both the full /v1/completions response and its stream chunks (OpenAI uses one shape)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageOut | None = None
    system_fingerprint: str | None = None


class ModelCard(_Out):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    status: str  # ours: loading / running
    parent: str | None = None  # a per-request adapter's base model (vLLM's field); absent for a model


class ModelList(_Out):
    object: Literal["list"] = "list"
    data: list[ModelCard]
