"""OpenAI Responses API request bodies (POST /v1/responses) as pydantic models.

The same rule as the other APIs (api/unknown_fields.py): unknown top-level fields are accepted and ignored, known
ones are validated strictly. One level down, input items and content parts of a type OpenAI defines but Orchard
cannot render (files, audio, built-in tool calls) are parsed as such and refused by name in responses_convert; types
OpenAI does not define (yet) parse as Unknown* and are ignored, logged once and counted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    Tag,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from deployments.api.request_limits import (
    INT32_MAX,
    MAX_ID_CHARS,
    MAX_MESSAGES,
    MAX_TOOLS,
    IdString,
    at_most,
    at_most_chars,
    bounded_metadata,
    refuse_invalid_unicode,
)
from deployments.api.mcp_schemas import (
    McpApprovalRequestItem,
    McpApprovalResponseItem,
    McpCallItem,
    McpListToolsItem,
    McpTool,
    McpToolChoice,
)
from deployments.api.unknown_fields import accept_unknown_fields
from engine.errors import InvalidRequestError


class _Lenient(BaseModel):
    # Items replayed from OpenAI carry keys we do not use (id, status, annotations, phase, ...): ignored.
    model_config = ConfigDict(extra="ignore")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=(), allow_inf_nan=False)


def _by_type(known: set[str], default: str | None = None) -> Callable[[Any], str]:
    """A discriminator: the `type` of a known member, else "unknown" (a type newer than this server)."""

    def tag(value: Any) -> str:
        kind = value.get("type", default) if isinstance(value, dict) else getattr(value, "type", default)
        return kind if isinstance(kind, str) and kind in known else "unknown"

    return tag


# ---- content parts ------------------------------------------------------------------------------
class InputTextPart(_Lenient):
    type: Literal["input_text"]
    text: str


class OutputTextPart(_Lenient):
    type: Literal["output_text"]
    text: str


class RefusalPart(_Lenient):
    type: Literal["refusal"]
    refusal: str


class InputImagePart(_Lenient):
    """An image by URL (a data URL, or http(s) where the ingress allows remote media); a `file_id` is refused (no
    Files API here). `detail` is checked on conversion (api/images.py)."""

    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None


class MediaPart(_Lenient):
    """Files and audio: refused by name (no reader for them here)."""

    type: Literal["input_file", "input_audio"]


class UnknownPart(_Lenient):
    type: str


_MEDIA = {"input_file", "input_audio"}
_PARTS = {"input_text": InputTextPart, "output_text": OutputTextPart, "refusal": RefusalPart,
          "input_image": InputImagePart, **{kind: MediaPart for kind in sorted(_MEDIA)}, "unknown": UnknownPart}
ContentPart = Annotated[
    Union[tuple(Annotated[model, Tag(kind)] for kind, model in _PARTS.items())],  # noqa: UP007
    Discriminator(_by_type(set(_PARTS) - {"unknown"})),
]


# ---- input items ----------------------------------------------------------------------------------
class MessageItem(_Lenient):
    type: Literal["message"] = "message"  # EasyInputMessage: type may be left out
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]


class FunctionCallItem(_Lenient):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Lenient):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]


class ReasoningPart(_Lenient):
    type: Literal["summary_text", "reasoning_text"]
    text: str


class ReasoningItem(_Lenient):
    """Earlier reasoning: its text goes back to templates as reasoning_content; encrypted_content is not ours."""

    type: Literal["reasoning"]
    summary: list[ReasoningPart] = Field(default_factory=list)
    content: list[ReasoningPart] | None = None


class UnsupportedItem(_Lenient):
    """An item type OpenAI defines that holds what a text model here cannot see or do (built-in tool calls and
    their outputs, compaction, references to items stored elsewhere): refused by name."""

    type: str


class UnknownItem(_Lenient):
    type: str


# OpenAI's input item types that carry conversation Orchard cannot render (openai SDK 3.57, ResponseInputItemParam).
UNSUPPORTED_ITEM_TYPES = {
    "file_search_call", "computer_call", "computer_call_output", "web_search_call", "tool_search_call",
    "tool_search_output", "additional_tools", "configuration_update", "compaction", "compaction_trigger",
    "image_generation_call", "code_interpreter_call", "local_shell_call", "local_shell_call_output", "shell_call",
    "shell_call_output", "apply_patch_call", "apply_patch_call_output", "custom_tool_call", "custom_tool_call_output", "item_reference", "program",
    "program_output",
}
_ITEMS = {"message": MessageItem, "function_call": FunctionCallItem, "function_call_output": FunctionCallOutputItem,
          "reasoning": ReasoningItem, "mcp_list_tools": McpListToolsItem, "mcp_call": McpCallItem,
          "mcp_approval_request": McpApprovalRequestItem, "mcp_approval_response": McpApprovalResponseItem,
          **{kind: UnsupportedItem for kind in sorted(UNSUPPORTED_ITEM_TYPES)},
          "unknown": UnknownItem}
InputItem = Annotated[
    Union[tuple(Annotated[model, Tag(kind)] for kind, model in _ITEMS.items())],  # noqa: UP007
    Discriminator(_by_type(set(_ITEMS) - {"unknown"}, default="message")),
]
INPUT_ITEMS: TypeAdapter[list[InputItem]] = TypeAdapter(list[InputItem])


# ---- tools, tool choice, formats -------------------------------------------------------------------
class FunctionTool(_Lenient):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class HostedTool(_Lenient):
    """A built-in tool (web_search, file_search, mcp, custom, ...): the server would run it; see responses_convert."""

    type: str


GroupedTool = Annotated[
    Annotated[FunctionTool, Tag("function")] | Annotated[HostedTool, Tag("unknown")],
    Discriminator(_by_type({"function"})),
]


class NamespaceTool(_Lenient):
    """Tools grouped under a name (Codex sends its multi-agent tools and each MCP server's tools so, on every
    request): their functions are offered as functions, and a call to one comes back with its `namespace`."""

    type: Literal["namespace"]
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    tools: list[GroupedTool] = Field(default_factory=list, max_length=MAX_TOOLS)


Tool = Annotated[
    Annotated[FunctionTool, Tag("function")] | Annotated[NamespaceTool, Tag("namespace")]
    | Annotated[McpTool, Tag("mcp")] | Annotated[HostedTool, Tag("unknown")],
    Discriminator(_by_type({"function", "namespace", "mcp"})),
]


class FunctionChoice(_Strict):
    type: Literal["function"]
    name: str


class AllowedToolRef(_Lenient):
    type: str
    name: str | None = None


class AllowedToolsChoice(_Strict):
    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[AllowedToolRef]


class HostedToolChoice(_Lenient):
    """A choice naming a built-in tool ({"type": "web_search_preview"}, mcp, custom, ...): refused by name."""

    type: str


ToolChoice = Annotated[
    Annotated[FunctionChoice, Tag("function")]
    | Annotated[AllowedToolsChoice, Tag("allowed_tools")]
    | Annotated[McpToolChoice, Tag("mcp")]
    | Annotated[HostedToolChoice, Tag("unknown")],
    Discriminator(_by_type({"function", "allowed_tools", "mcp"})),
]


class TextFormatText(_Strict):
    type: Literal["text"]


class TextFormatJsonObject(_Strict):
    type: Literal["json_object"]


class TextFormatJsonSchema(_Strict):
    """Flat, unlike chat's response_format: {"type": "json_schema", "name", "schema", "description", "strict"}."""

    type: Literal["json_schema"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None  # accepted: the schema is always enforced


class TextConfig(_Lenient):
    format: Annotated[TextFormatText | TextFormatJsonObject | TextFormatJsonSchema,
                      Field(discriminator="type")] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # a hint for OpenAI's models: accepted, echoed


class ReasoningConfig(_Lenient):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # no summarizer here: reasoning comes as text


class StreamOptions(_Lenient):
    include_obfuscation: bool | None = None  # padding against length side channels: not sent


# ---- the request ---------------------------------------------------------------------------------
class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow", protected_namespaces=(), allow_inf_nan=False)

    model: str = Field(min_length=1)
    # A list's max_length would name the union member: the validator below names "input".
    input: str | Annotated[list[InputItem], Field(json_schema_extra={"maxItems": MAX_MESSAGES})]
    instructions: str | None = None
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    max_tool_calls: int | None = Field(None, ge=1)  # bounds the MCP tool loop's calls (the only built-in tool here)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(None, ge=0, le=20)
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    store: bool | None = None  # null: true, as OpenAI
    # Echoed in every Response object and kept with it in the store: bounded (request_limits).
    previous_response_id: IdString | None = None
    background: bool | None = None
    include: list[str] | None = None
    metadata: dict[str, str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    user: IdString | None = None
    prompt_cache_key: IdString | None = None  # the prefix cache needs no key
    safety_identifier: IdString | None = None
    service_tier: IdString | None = None  # one tier here
    # Ours (as on chat completions): false keeps this request from speculating (null: true).
    speculative: StrictBool | None = None

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, body: Any) -> Any:
        return refuse_invalid_unicode(body)

    @model_validator(mode="after")
    def _unknown_fields(self) -> ResponsesRequest:
        accept_unknown_fields("responses", self.model_extra)
        return self

    @field_validator("metadata")
    @classmethod
    def _bounded_metadata(cls, metadata: dict[str, str] | None) -> dict[str, str] | None:
        return bounded_metadata(metadata)

    @field_validator("tool_choice")
    @classmethod
    def _bounded_tool_choice(cls, choice: Any) -> Any:
        """The names a tool choice holds are echoed (and stored) as given, or quoted in the error that refuses
        them: bounded like ids. Checked here to name the place, not the union member (`tool_choice.tools[1].name`)."""
        if isinstance(choice, FunctionChoice):
            at_most_chars(choice.name, MAX_ID_CHARS, "tool_choice.name")
        elif isinstance(choice, AllowedToolsChoice):
            if len(choice.tools) > MAX_TOOLS:
                raise InvalidRequestError(f"Invalid 'tool_choice.tools': at most {MAX_TOOLS} tools are allowed, got "
                                          f"{len(choice.tools)}", param="tool_choice.tools")
            for index, ref in enumerate(choice.tools):
                at_most_chars(ref.type, MAX_ID_CHARS, f"tool_choice.tools[{index}].type")
                at_most_chars(ref.name, MAX_ID_CHARS, f"tool_choice.tools[{index}].name")
        elif isinstance(choice, HostedToolChoice):
            at_most_chars(choice.type, MAX_ID_CHARS, "tool_choice.type")
        return choice

    @field_validator("input", mode="before")
    @classmethod
    def _valid_items(cls, items: Any) -> Any:
        """Items are checked here so that an error names the item as OpenAI does (`input[2].content[0].text`),
        not the union members pydantic would list first."""
        if isinstance(items, str):
            return items
        if not isinstance(items, list):
            raise InvalidRequestError("'input' must be a string or a list of input items", param="input")
        at_most(items, MAX_MESSAGES, "input items")
        try:
            return INPUT_ITEMS.validate_python(items)
        except ValidationError as exc:
            deepest = max(exc.errors(), key=lambda e: len(e["loc"]))
            param = _item_param(deepest["loc"])
            raise InvalidRequestError(f"Invalid '{param}': {deepest['msg']}", param=param) from None

    @property
    def stores(self) -> bool:
        return self.store is not False


_UNION_PARTS = {"str", *_ITEMS, *_PARTS}  # what pydantic adds to a location: union members and tags


def _item_param(loc: tuple[Any, ...]) -> str:
    """A pydantic error location in the input list as OpenAI writes it, without union tags: input[0].content[1]."""
    param = "input"
    for part in loc:
        if isinstance(part, int):
            param += f"[{part}]"
        elif part not in _UNION_PARTS and str(part).isidentifier():
            param += f".{part}"
    return param
