"""OpenAI request bodies (chat completions, completions) as pydantic models.

Unknown top-level fields are accepted and ignored (logged once, counted: api/unknown_fields.py), since clients add
fields with every release; known fields are validated strictly, and the few unknown ones that would change the
answer are refused by name. Fields of later issues (tools) are shape-checked now. Numbers are bounded by what the
engine can hold (request_limits); the engine checks them again against the model (vocabulary, context).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator

from deployments.api.unknown_fields import accept_unknown_fields
from deployments.api.request_limits import (
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    MAX_MESSAGES,
    MAX_STOP_STRINGS,
    MAX_TOOLS,
    IdString,
    at_most,
    bounded_metadata,
    refuse_invalid_unicode,
)


class _Strict(BaseModel):
    # Python's json reads NaN and Infinity literals: no float field takes them.
    model_config = ConfigDict(extra="forbid", protected_namespaces=(), allow_inf_nan=False)


class _Lenient(BaseModel):
    # Messages replayed from other servers carry extra keys (e.g. reasoning_content): ignore them.
    model_config = ConfigDict(extra="ignore")


# ---- message content -----------------------------------------------------------
class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class ImageUrl(_Lenient):
    url: str
    detail: str | None = None


class ImagePart(_Lenient):
    type: Literal["image_url"]
    image_url: ImageUrl


class VideoUrlPart(_Lenient):
    """A video file as a data URL (vLLM's and mlx-vlm's shape; OpenAI's API has none)."""

    type: Literal["video_url"]
    video_url: ImageUrl


class VideoFramesPart(_Lenient):
    """A video as its frames, each an image data URL (mlx-vlm's server's shape)."""

    type: Literal["video"]
    video: list[str] = Field(min_length=1)


class AudioPart(_Lenient):
    type: Literal["input_audio"]
    input_audio: dict[str, Any]


class FilePart(_Lenient):
    type: Literal["file"]
    file: dict[str, Any]


ContentPart = Annotated[
    Union[TextPart, ImagePart, VideoUrlPart, VideoFramesPart, AudioPart, FilePart], Field(discriminator="type")
]


class FunctionCall(_Lenient):
    name: str
    arguments: str


class ToolCall(_Lenient):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class SystemMessage(_Lenient):
    role: Literal["system", "developer"]
    content: str | list[TextPart]
    name: str | None = None


class UserMessage(_Lenient):
    role: Literal["user"]
    content: str | list[ContentPart]
    name: str | None = None


class AssistantMessage(_Lenient):
    role: Literal["assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    refusal: str | None = None
    reasoning_content: str | None = None  # replayed from our own (or vLLM's) earlier answers


class ToolMessage(_Lenient):
    role: Literal["tool"]
    content: str | list[TextPart]
    tool_call_id: str


ChatMessage = Annotated[
    Union[SystemMessage, UserMessage, AssistantMessage, ToolMessage], Field(discriminator="role")
]


# ---- tools and formats ------------------------------------------------------------------
class FunctionDefinition(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # accepted: the schema is always enforced


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_matches_type(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type 'json_schema' needs a 'json_schema' object")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"'json_schema' is only allowed when the type is 'json_schema', not '{self.type}'")
        return self


class StreamOptions(_Strict):
    include_usage: bool = False
    # vLLM's (guidellm sends it): accepted; the usage comes in the last chunk, as with include_usage alone.
    continuous_usage_stats: bool = False


# ---- request bodies ----------------------------------------------------------------
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]


class _SamplingFields(BaseModel):
    """Sampling fields shared by both endpoints (OpenAI's plus the common vLLM extras)."""

    model_config = ConfigDict(extra="allow", protected_namespaces=(), allow_inf_nan=False)

    model: str = Field(min_length=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)  # at or above the vocabulary: every token
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    # A list's max_length would name the union member ("stop.list[str]"): the validator below names "stop".
    stop: str | Annotated[list[str], Field(json_schema_extra={"maxItems": MAX_STOP_STRINGS})] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    n: int | None = Field(None, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: IdString | None = None  # accepted and ignored (no per-user accounting here); bounded as an id
    response_format: ResponseFormat | None = None
    # vLLM's structured-output extras (at most one of them, and not with a JSON response_format).
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    # Ours: false keeps this request from speculating on a model configured to (null: true).
    speculative: StrictBool | None = None

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, body: Any) -> Any:
        return refuse_invalid_unicode(body)

    @model_validator(mode="after")
    def _unknown_fields(self) -> "_SamplingFields":
        accept_unknown_fields("openai", self.model_extra)
        return self

    @field_validator("stop")
    @classmethod
    def _few_stop_strings(cls, stop: str | list[str] | None) -> str | list[str] | None:
        return at_most(stop, MAX_STOP_STRINGS, "stop strings")


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None  # OpenAI platform bookkeeping: accepted, unused, held to OpenAI's bounds
    store: bool | None = None

    @field_validator("metadata")
    @classmethod
    def _bounded_metadata(cls, metadata: dict[str, str] | None) -> dict[str, str] | None:
        return bounded_metadata(metadata)


class CompletionRequest(_SamplingFields):
    # Token ids are checked against the vocabulary by the engine (param "prompt"; bounds here would name a member).
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1, le=INT32_MAX)  # OpenAI's default for /v1/completions
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)
