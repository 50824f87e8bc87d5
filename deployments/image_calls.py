"""What crosses between the ingress and an image model (model_type image-generation or image-edit): plain dataclasses
(a contract module, as speech_calls.py is). Errors travel as values."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from engine.errors import OrchardError


@dataclass
class ImageJob:
    """One /v1/images/generations or /v1/images/edits request, checked by the ingress (api/image_schemas.py)."""

    prompt: str
    n: int = 1
    width: int = 1024
    height: int = 1024
    steps: int | None = None  # None: the family's default
    guidance: float | None = None
    seed: int | None = None  # None: one drawn here; image i of n uses seed + i
    output_format: Literal["png", "jpeg", "webp"] = "png"
    output_compression: int = 100  # jpeg / webp quality, 0-100
    images: list[bytes] = field(default_factory=list)  # an edit's images, as uploaded
    mask: bytes | None = None  # an edit's mask: where it is transparent the image is edited, elsewhere kept
    log_id: str = ""


@dataclass
class ImageUsage:
    input_tokens: int = 0  # the prompt's words, as a local diffusion model has no token count to give
    output_tokens: int = 0  # denoising steps run

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens


@dataclass
class ImageEvent:
    """Progress (`step` of `steps` for image `index`), a finished image (`image`: encoded bytes, with its `seed`), or
    the last event: `done` with the usage, or `error`."""

    index: int = 0
    step: int = 0
    steps: int = 0
    image: bytes | None = None
    seed: int | None = None
    done: bool = False
    usage: ImageUsage | None = None
    error: OrchardError | None = None
