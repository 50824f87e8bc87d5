"""Anthropic Messages API request bodies (POST /v1/messages, /v1/messages/count_tokens).

Known top-level fields are checked strictly; unknown ones are accepted and ignored (logged once, counted:
api/unknown_fields.py), since Claude Code adds fields with its releases. Content blocks and tools ignore keys we do
not use, so `citations` and the like are accepted anywhere; `cache_control` is checked (`ephemeral`, ttl 5m / 1h) and
needs nothing here (the prefix cache reuses any prompt prefix). Shapes are those Claude Code 2.1 sends
(tests/fixtures/agents/claude_code).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator

from deployments.api.mcp_schemas import MAX_MCP_SERVERS, McpServerDefinition, McpToolResultBlock, McpToolUseBlock
from deployments.api.unknown_fields import accept_unknown_fields
from engine.errors import InvalidRequestError
from deployments.api.request_limits import (
    INT32_MAX,
    MAX_ID_CHARS,
    MAX_MESSAGES,
    MAX_STOP_STRINGS,
    MAX_SYSTEM_BLOCKS,
    MAX_TOOLS,
    IdString,
    at_most,
    at_most_chars,
    refuse_invalid_unicode,
)


class _Strict(BaseModel):
    # Python's json reads NaN and Infinity literals: no float field takes them.
    model_config = ConfigDict(extra="forbid", protected_namespaces=(), allow_inf_nan=False)


class CacheControl(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class _Block(BaseModel):
    model_config = ConfigDict(extra="ignore")

    cache_control: CacheControl | None = None  # prompt caching hint: our prefix cache needs none


class TextBlock(_Block):
    type: Literal["text"]
    text: str


class ImageBlock(_Block):
    type: Literal["image"]
    source: dict[str, Any]


class DocumentBlock(_Block):
    """A document: plain text (`text` source) or text blocks (`content` source) are read as text; a PDF (`base64`),
    `url` or `file` source needs a reader this server does not have (refused on conversion)."""

    type: Literal["document"]
    source: dict[str, Any]
    title: str | None = None
    context: str | None = None


class ToolReferenceBlock(_Block):
    """In a tool result (Claude Code's ToolSearch): the named deferred tool (`defer_loading`) is now offered."""

    type: Literal["tool_reference"]
    tool_name: str


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[
        Annotated[Union[TextBlock, ImageBlock, DocumentBlock, ToolReferenceBlock], Field(discriminator="type")]
    ] = ""
    is_error: bool = False


class ThinkingBlock(_Block):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Block):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[
    Union[TextBlock, ImageBlock, DocumentBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock, RedactedThinkingBlock,
          McpToolUseBlock, McpToolResultBlock],
    Field(discriminator="type"),
]


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    # "system" is not Anthropic's, but clients replaying OpenAI-style histories send it: accepted.
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]


# Anthropic's own tool types carry a date: web_search_20250305, web_fetch_20250910, bash_20250124, ...
_ANTHROPIC_TOOL_TYPE = re.compile(r"[a-z][a-z0-9_]*_\d{8}|mcp_toolset")


class ToolDefinition(_Block):
    """A custom tool (no type, or "custom") with its input_schema, or one of Anthropic's own tools (web search, code
    execution, its bash / text editor, an MCP toolset), which Anthropic runs or shapes: accepted, never offered to
    the model; a tool_choice naming one is refused."""

    type: str | None = None
    name: str | None = Field(None, min_length=1, max_length=128)  # an mcp_toolset has none
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    # Loaded on demand: offered to the model once a tool result's tool_reference names it (Claude Code's ToolSearch).
    defer_loading: bool = False

    @property
    def custom(self) -> bool:
        return self.type in (None, "custom")

    @field_validator("type")
    @classmethod
    def _known_type(cls, value: str | None) -> str | None:
        if value not in (None, "custom") and not _ANTHROPIC_TOOL_TYPE.fullmatch(value):
            raise ValueError(
                f"unknown tool type '{value}': give 'custom' (or no type) with an input_schema, "
                "or one of Anthropic's tool types such as 'web_search_20250305'"
            )
        return value


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(BaseModel):
    """`enabled` / `disabled` switch the chat template's thinking; `adaptive` (Claude Code's) leaves the template's
    default. A budget is accepted and not enforced: the answer's max_tokens bounds the thinking."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    display: str | None = None  # "summarized" / "omitted": how Anthropic shows its thinking


class JsonSchemaFormat(BaseModel):
    """Structured output: the answer's text is JSON matching `schema` (enforced by constrained decoding)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    """Claude Code sends {"effort": ...}: accepted (there is no effort knob here); `format` is structured output."""

    model_config = ConfigDict(extra="ignore")

    effort: str | None = None
    format: JsonSchemaFormat | None = None


class ContextEdit(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str  # clear_thinking_20251015, clear_tool_uses_20250919, ...


class ContextManagement(BaseModel):
    """Anthropic's server-side clearing of old thinking / tool results: accepted; the prompt is used whole here."""

    model_config = ConfigDict(extra="ignore")

    edits: list[ContextEdit] = Field(default_factory=list)


class Metadata(BaseModel):
    """Anthropic's request metadata: `user_id` (Claude Code's is a JSON string of about 150 characters), bounded as an
    id; other keys are accepted (unused, never echoed)."""

    model_config = ConfigDict(extra="allow")

    user_id: IdString | None = None


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
    output_format: JsonSchemaFormat | None = None  # the structured-outputs beta's name for output_config.format
    context_management: ContextManagement | None = None

    @model_validator(mode="after")
    def _unknown_fields(self) -> "_MessagesFields":
        accept_unknown_fields("anthropic", self.model_extra)
        return self

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, body: Any) -> Any:
        return refuse_invalid_unicode(body)

    @field_validator("tools")
    @classmethod
    def _custom_tools_complete(cls, tools: list[ToolDefinition] | None) -> list[ToolDefinition] | None:
        for index, tool in enumerate(tools or []):
            for name in ("name", "input_schema"):
                if tool.custom and getattr(tool, name) is None:
                    raise InvalidRequestError(f"A custom tool needs '{name}'", param=f"tools.{index}.{name}")
        return tools

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
    metadata: Metadata | None = None  # accepted, unused
    # Accepted and unused: they concern Anthropic's own service. Ids are bounded all the same (request_limits).
    service_tier: IdString | None = None
    container: Any = None  # a container's id, or its parameters
    # The MCP connector: the ingress runs these servers' tools in its tool loop (mcp/tool_loop.py).
    mcp_servers: list[McpServerDefinition] | None = Field(None, max_length=MAX_MCP_SERVERS)
    # Ours (as on the OpenAI routes): false keeps this request from speculating (null: true).
    speculative: StrictBool | None = None
    # Ours (the Responses API's field): the MCP tool calls this answer may run; a forced tool_choice holds while
    # they last (null: for the first turn only).
    max_tool_calls: int | None = Field(None, ge=1, le=INT32_MAX)

    @field_validator("container")
    @classmethod
    def _bounded_container(cls, container: Any) -> Any:
        return at_most_chars(container, MAX_ID_CHARS, "container")


class CountTokensRequest(_MessagesFields):
    pass
