"""OpenAI's image request bodies (/v1/images/generations JSON, /v1/images/edits multipart fields) with Bodega's
additions (seed, guidance_scale, steps, negative_prompt), the answer and the streamed events.

Strict on what changes the image: size (WxH, multiples of 16, 64-2048 a side, or auto: 1024x1024), n, the output
format. Fields a local diffusion model has no use for (quality, style, moderation, user) are accepted and logged;
`background: transparent` and `response_format: url` are refused, since neither can be honoured here.
"""

from __future__ import annotations

import base64
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from deployments.api.request_limits import refuse_invalid_unicode
from deployments.api.unknown_fields import accept_unknown_fields
from deployments.image_calls import ImageJob, ImageUsage

MIN_SIDE, MAX_SIDE, SIDE_STEP = 64, 2048, 16
DEFAULT_SIZE = (1024, 1024)
IGNORED_FIELDS = ("quality", "style", "moderation", "user", "input_fidelity")


class ImageRequest(BaseModel):
    """What both image routes take (the edit's files come beside it: ingress/image_routes.py)."""

    model_config = ConfigDict(extra="allow", protected_namespaces=(), allow_inf_nan=False)

    model: str
    prompt: str = Field(min_length=1, max_length=32000)
    n: int = Field(1, ge=1, le=10)
    size: str = "auto"
    response_format: Literal["b64_json", "url"] | None = None
    output_format: Literal["png", "jpeg", "webp"] = "png"
    output_compression: int = Field(100, ge=0, le=100)
    background: Literal["transparent", "opaque", "auto"] | None = None
    stream: bool = False
    partial_images: int = Field(0, ge=0, le=3)
    quality: str | None = None
    style: str | None = None
    moderation: str | None = None
    user: str | None = None
    input_fidelity: str | None = None
    seed: int | None = Field(None, ge=0, lt=2**32)
    guidance_scale: float | None = Field(None, ge=0.0, le=30.0)
    steps: int | None = Field(None, ge=1, le=100)
    negative_prompt: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, body: Any) -> Any:
        return refuse_invalid_unicode(body)

    @model_validator(mode="after")
    def _checked(self) -> "ImageRequest":
        accept_unknown_fields("openai", self.model_extra)
        if self.response_format == "url":
            raise ValueError("'response_format' url: this server hosts no image files; images come as b64_json")
        if self.background == "transparent":
            raise ValueError("'background' transparent: the models served here paint opaque images")
        if self.negative_prompt and self.negative_prompt.strip():
            raise ValueError("'negative_prompt': the image models served here (FLUX.2 [klein]) take none")
        if not self.prompt.strip():
            raise ValueError("'prompt' holds no text")
        return self

    @field_validator("size")
    @classmethod
    def _valid_size(cls, size: str) -> str:
        parse_size(size)
        return size

    @property
    def ignored(self) -> list[str]:
        return [name for name in IGNORED_FIELDS if getattr(self, name) is not None]

    def job(self, log_id: str) -> ImageJob:
        width, height = parse_size(self.size)
        return ImageJob(self.prompt, self.n, width, height, self.steps, self.guidance_scale, self.seed,
                        self.output_format, self.output_compression, log_id=log_id)


def parse_size(size: str) -> tuple[int, int]:
    """'WxH' (or 'auto') as (width, height); ValueError naming what a size may be."""
    if size == "auto":
        return DEFAULT_SIZE
    width, x, height = size.partition("x")
    if x and width.isdigit() and height.isdigit():
        sides = int(width), int(height)
        if all(MIN_SIDE <= side <= MAX_SIDE and side % SIDE_STEP == 0 for side in sides):
            return sides
    raise ValueError(f"'size' {size[:32]!r} is not served: WIDTHxHEIGHT with each side a multiple of {SIDE_STEP} "
                     f"from {MIN_SIDE} to {MAX_SIDE} (e.g. 1024x1024, 1536x1024), or auto")


def usage_body(usage: ImageUsage) -> dict[str, Any]:
    return {"input_tokens": usage.input_tokens, "output_tokens": usage.output_tokens,
            "total_tokens": usage.total_tokens,
            "input_tokens_details": {"text_tokens": usage.input_tokens, "image_tokens": 0}}


def images_body(request: ImageRequest, images: list[bytes], usage: ImageUsage) -> dict[str, Any]:
    """OpenAI's ImagesResponse."""
    width, height = parse_size(request.size)
    return {"created": int(time.time()), "data": [{"b64_json": base64.b64encode(image).decode()} for image in images],
            "background": "opaque", "output_format": request.output_format, "size": f"{width}x{height}",
            "usage": usage_body(usage)}


def completed_event(kind: str, request: ImageRequest, image: bytes, usage: ImageUsage | None) -> dict[str, Any]:
    """A streamed image: OpenAI's image_generation.completed (image_edit.completed for edits)."""
    width, height = parse_size(request.size)
    event = {"type": f"{kind}.completed", "b64_json": base64.b64encode(image).decode(), "created_at": int(time.time()),
             "size": f"{width}x{height}", "quality": "auto", "background": "opaque",
             "output_format": request.output_format}
    if usage is not None:
        event["usage"] = usage_body(usage)
    return event


__all__ = ["ImageRequest", "completed_event", "images_body", "parse_size"]
