"""Anthropic Messages API request bodies (POST /v1/messages, /v1/messages/count_tokens).

Known top-level fields are checked strictly; unknown ones are accepted and ignored (logged once, counted:
api/unknown_fields.py), since Claude Code adds fields with its releases. Content blocks and tools ignore keys we do
not use, so `cache_control`, `citations` and the like are accepted anywhere.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from deployments.api.unknown_fields import accept_unknown_fields
from engine.errors import InvalidRequestError
from deployments.api.request_limits import (
    INT32_MAX,
    MAX_MESSAGES,
    MAX_STOP_STRINGS,
    MAX_SYSTEM_BLOCKS,
    MAX_TOOLS,
    at_most,
    refuse_invalid_unicode,
)


class _Strict(BaseModel):
    # Python's json reads NaN and Infinity literals: no float field takes them.
    model_config = ConfigDict(extra="forbid", protected_namespaces=(), allow_inf_nan=False)


class _Block(BaseModel):
    model_config = ConfigDict(extra="ignore")

    cache_control: dict[str, Any] | None = None  # prompt caching hint: our prefix cache needs none


class TextBlock(_Block):
    type: Literal["text"]
    text: str


class ImageBlock(_Block):
    type: Literal["image"]
    source: dict[str, Any]


class DocumentBlock(_Block):
    type: Literal["document"]
    source: dict[str, Any]


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[Union[TextBlock, ImageBlock, DocumentBlock], Field(discriminator="type")]] = ""
    is_error: bool = False


class ThinkingBlock(_Block):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Block):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[
    Union[TextBlock, ImageBlock, DocumentBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock, RedactedThinkingBlock],
    Field(discriminator="type"),
]


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    # "system" is not Anthropic's, but clients replaying OpenAI-style histories send it: accepted.
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]


class ToolDefinition(_Block):
    type: Literal["custom"] | None = None  # server tools (web_search, bash, ...) are not ours to run
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class OutputConfig(BaseModel):
    """Claude Code sends {"effort": ...}: accepted (there is no effort knob here); a structured output `format`
    is not honoured yet and is refused by name."""

    model_config = ConfigDict(extra="ignore")

    effort: str | None = None
    format: Any = None

    @field_validator("format")
    @classmethod
    def _no_format(cls, value: Any) -> Any:
        if value is not None:
            raise InvalidRequestError("'output_config.format' is not supported yet", param="output_config.format")
        return value


class _MessagesFields(BaseModel):
    model_config = ConfigDict(extra="allow", protected_namespaces=(), allow_inf_nan=False)

    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    # A list's max_length would name the union member ("system.list[TextBlock]"): the validator below names "system".
    system: str | Annotated[list[TextBlock], Field(json_schema_extra={"maxItems": MAX_SYSTEM_BLOCKS})] | None = None
    tools: list[ToolDefinition] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    # Ours (as on the OpenAI route): extra chat-template switches, e.g. {"enable_thinking": false}.
    chat_template_kwargs: dict[str, Any] | None = None
    output_config: OutputConfig | None = None

    @model_validator(mode="after")
    def _unknown_fields(self) -> "_MessagesFields":
        accept_unknown_fields("anthropic", self.model_extra)
        return self

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, body: Any) -> Any:
        return refuse_invalid_unicode(body)

    @field_validator("system")
    @classmethod
    def _few_system_blocks(cls, system: str | list[TextBlock] | None) -> str | list[TextBlock] | None:
        return at_most(system, MAX_SYSTEM_BLOCKS, "system blocks")


class MessagesRequest(_MessagesFields):
    max_tokens: int = Field(ge=1, le=INT32_MAX)
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOP_STRINGS)
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=INT32_MAX)  # at or above the vocabulary: every token
    stream: bool = False
    metadata: dict[str, Any] | None = None  # e.g. Claude Code's user_id: accepted, unused
    # Accepted and unused: they concern Anthropic's own service.
    service_tier: str | None = None
    container: Any = None
    context_management: Any = None
    mcp_servers: list[Any] | None = None


class CountTokensRequest(_MessagesFields):
    pass
