"""What a request asks its output to match (structured output); compiled elsewhere.

The API layer turns `response_format`, a forced tool call or an extra like
`guided_regex` into one of these; the engine compiles it against the model's
tokenizer and masks each step's logits so only matching continuations remain.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

GuidedKind = Literal["json_schema", "json_object", "regex", "choice"]


@dataclass(frozen=True)
class GuidedDecoding:
    """kind "json_schema": spec is the schema as JSON text; "json_object": spec is "";
    "regex": spec is the pattern; "choice": spec is a JSON list of the allowed strings."""

    kind: GuidedKind
    spec: str = ""
    # The request field that asked for it, named in errors ("response_format", "tool_choice", ...).
    param: str = field(default="response_format", compare=False)


__all__ = ["GuidedDecoding", "GuidedKind"]
