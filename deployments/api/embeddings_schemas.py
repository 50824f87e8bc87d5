"""OpenAI's /v1/embeddings request and response bodies.

`truncate` is Orchard's extension (off by default, as OpenAI refuses long inputs): true cuts each input to the
model's max_seq_length instead of refusing it. Unknown top-level fields are tolerated as on the other routes.
"""

from __future__ import annotations

import base64
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from deployments.api.request_limits import at_most, refuse_invalid_unicode
from deployments.api.unknown_fields import accept_unknown_fields
from deployments.model_calls import EmbedJob, EmbedResult

# OpenAI's limit on inputs per request.
MAX_EMBEDDING_INPUTS = 2048


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="allow", protected_namespaces=(), allow_inf_nan=False)

    model: str
    # A string, strings, token ids (one input), or lists of token ids (one input each).
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None  # accepted and ignored (no per-user accounting here)
    truncate: bool = False

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, body: Any) -> Any:
        return refuse_invalid_unicode(body)

    @model_validator(mode="after")
    def _unknown_fields(self) -> "EmbeddingRequest":
        accept_unknown_fields("openai", self.model_extra)
        return self

    @field_validator("input")
    @classmethod
    def _inputs_within_limits(cls, value: Any) -> Any:
        if isinstance(value, list):
            if not value:
                raise ValueError("give at least one input")
            if isinstance(value[0], list) and any(not ids for ids in value):
                raise ValueError("a list of token ids must not be empty")
            at_most(value, MAX_EMBEDDING_INPUTS, "inputs")
        return value

    def inputs(self) -> list[str] | list[list[int]]:
        """One entry per input: a lone string or a lone list of token ids is one input."""
        if isinstance(self.input, str):
            return [self.input]
        if self.input and isinstance(self.input[0], int):
            return [list(self.input)]  # type: ignore[arg-type]
        return list(self.input)  # type: ignore[arg-type]

    def job(self, log_id: str) -> EmbedJob:
        return EmbedJob(self.inputs(), truncate=self.truncate, dimensions=self.dimensions, log_id=log_id)


def embedding_response(body: EmbeddingRequest, result: EmbedResult) -> dict[str, Any]:
    """OpenAI's list of embeddings: float lists, or base64 of the little-endian float32 bytes."""
    if body.encoding_format == "base64":
        vectors: list[Any] = [base64.b64encode(raw).decode("ascii") for raw in result.vectors]
    else:
        vectors = [np.frombuffer(raw, dtype="<f4").tolist() for raw in result.vectors]
    return {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": vector} for i, vector in enumerate(vectors)],
        "model": body.model,
        "usage": {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens},
    }
