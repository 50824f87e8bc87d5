"""Prompts with images prefilled several in one forward: the language model as backbone + head, fed each prompt's
embeddings and its own multimodal positions (Qwen's M-RoPE `position_ids`, which come with the merge).

Through mlx-vlm's `LanguageModel` call each such prompt ran alone, its positions kept as model state, with logits
over every position: one launch-bound forward per prompt in a host-bound step (32 streams of which half carry an image
ran at 0.66-0.69 of text-only's rate on an H200 at 0d44f01, the tower counting for less than half of the gap). Split,
the prompts of a step run as one right-padded batch and the head runs on their last positions only. A model is
split only where a probe forward of the backbone + head equals its own call bit for bit (`agrees`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import mlx.core as mx

from engine.models.head_split import HeadSplit
from engine.vision.model import EmbeddedPrompt, VisionLanguageModel

POSITIONS = "position_ids"
# The probe forward's tokens: a prompt's first ones (an image's tokens come early: after the system turn).
PROBE_TOKENS = 256


@dataclass(frozen=True)
class EmbeddedSplit:
    backbone: Callable[..., mx.array] = field(repr=False)  # (tokens, inputs_embeds, cache, position_ids) -> hidden
    head: Callable[[mx.array], mx.array] = field(repr=False)

    @staticmethod
    def takes(prompt: EmbeddedPrompt) -> bool:
        """Whether a prompt carries the positions the backbone is fed (else it runs through the model's call)."""
        positions = prompt.language_kwargs.get(POSITIONS)
        return isinstance(positions, mx.array) and positions.ndim == 3 and positions.shape[1] == 1

    def hidden(self, tokens: mx.array, embeds: mx.array, cache: Any, positions: mx.array) -> mx.array:
        return self.backbone(tokens, inputs_embeds=embeds, cache=cache, position_ids=positions)


def embedded_split(model: VisionLanguageModel, probe: EmbeddedPrompt, caches: Callable[[], Any]) -> EmbeddedSplit | None:
    """The split of this model's language model, checked on `probe` (a prompt with images) over fresh `caches()`;
    None where it has no text-head split, its prompts carry no positions, or the probe differs."""
    text_split: HeadSplit | None = model.head_split()
    backbone = getattr(model.language_model, "model", None)
    if text_split is None or not callable(backbone) or not EmbeddedSplit.takes(probe):
        return None
    split = EmbeddedSplit(backbone, text_split.head)
    return split if agrees(model, split, probe, caches) else None


def agrees(model: VisionLanguageModel, split: EmbeddedSplit, prompt: EmbeddedPrompt, caches: Callable[[], Any]) -> bool:
    """The split's logits over the prompt's first PROBE_TOKENS equal the model's call's (same shapes, so same
    kernels); no more, as the call's logits cover every position (a 16k-token prompt's: 4.9 GB in bf16)."""
    length = min(prompt.token_ids.shape[1], PROBE_TOKENS)
    try:
        whole = model.prefill_embedded(prompt, 0, length, caches())
        hidden = split.hidden(prompt.token_ids[:, :length], prompt.inputs_embeds[:, :length], caches(),
                              prompt.language_kwargs[POSITIONS][..., :length])
        parts = split.head(hidden)
        return whole.shape == parts.shape and bool(mx.array_equal(whole, parts).item())
    except Exception:  # noqa: BLE001 — an unexpected signature or structure: each prompt keeps the model's call
        return False


def padded_rows(parts: list[mx.array], axis: int, width: int) -> mx.array:
    """Arrays of one row each, right-padded with zeros to `width` along `axis`, stacked along the row axis (the axis
    before it): pads only feed positions after a row's own, which its causal attention never reads."""
    def widths(part: mx.array) -> list[tuple[int, int]]:
        return [(0, width - part.shape[axis]) if i == axis else (0, 0) for i in range(part.ndim)]

    return mx.concatenate([mx.pad(part, widths(part)) for part in parts], axis=axis - 1)


__all__ = ["EmbeddedSplit", "embedded_split", "padded_rows"]
