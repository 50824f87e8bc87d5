"""A vision-language model's language model as mlx-lm's own text model of the family, sharing its weights.

Decode rows of a VLM are text: mlx-lm ships text models for VLM folders (qwen2_vl for Qwen2-VL and Qwen2.5-VL,
qwen3_vl, gemma3, mistral3, ...), built on mx.fast.rope. mlx-vlm's language models apply multimodal rotary
positions (M-RoPE) in ~10 element-wise kernels a layer where no fused kernel exists (CUDA): measured on an H200,
a Qwen2.5-VL-3B decode step of one row took 21.2 ms against 14.3 ms for the same dimensions in mlx-lm (issue 54).
With the three M-RoPE axes equal, as every decode position is, M-RoPE is plain RoPE; a row whose images moved its
text positions (a "rope delta") gets that shift in its batch cache's offsets (runner/decode_batch.py).

The twin is built by mlx-lm's loader without reading weights (lazy), then takes the VLM's own arrays by name: no
second copy. It serves only where every parameter matches by name and shape, and a probe forward agrees.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from engine.models.head_split import HeadSplit, head_split

log = logging.getLogger(__name__)
PROBE_TOKENS = tuple(range(3, 19))
# Largest logit difference allowed, relative to the largest logit. Rotary rounding differs: 0 on the CPU, 2.2e-2 on
# an H200 (random Qwen2.5-VL-3B shape, bf16, 36 layers; 2e-2 refused that twin and decode cost 3x); a wrong rotary
# style or base differs by 0.45-1.4.
AGREEMENT = 0.1


def load_text_twin(folder: Path, vlm: Any) -> nn.Module | None:
    """mlx-lm's text model for `folder` on `vlm`'s (VisionLanguageModel) weights, or None where there is none."""
    from mlx_lm.utils import load_model

    try:
        twin, _ = load_model(folder, lazy=True)
    except Exception as exc:  # noqa: BLE001 — a family mlx-lm does not have, or lays out otherwise
        log.info("%s: no mlx-lm text model decodes it (%s); decode runs through mlx-vlm", folder.name, exc)
        return None
    theirs = dict(tree_flatten(vlm.vlm.parameters()))
    own = tree_flatten(twin.parameters())
    mismatched = [name for name, array in own if name not in theirs or theirs[name].shape != array.shape]
    if mismatched:
        log.info("%s: mlx-lm's text model does not match its weights (%s); decode runs through mlx-vlm",
                 folder.name, ", ".join(mismatched[:3]))
        return None
    twin.update(tree_unflatten([(name, theirs[name]) for name, _ in own]))
    if not _agrees(vlm, twin):
        log.info("%s: mlx-lm's text model disagrees with mlx-vlm's on a probe; decode runs through mlx-vlm", folder.name)
        return None
    log.info("%s: decode rows run through mlx-lm's %s on its weights", folder.name, type(twin).__module__)
    return twin


@dataclass(frozen=True)
class TextTwin:
    """The twin as the runner's text prefill calls it: the model, and its backbone + head split where that holds."""

    model: nn.Module
    split: HeadSplit | None


def twin_prefill(twin: nn.Module | None) -> TextTwin | None:
    """A VLM's text prefill through its twin (text prompts; text after cached images): mx.fast.rope instead of
    mlx-vlm's M-RoPE kernels, as its decode rows. The split of the twin's text model (qwen2_vl wraps qwen2's)."""
    if twin is None:
        return None
    return TextTwin(twin, head_split(getattr(twin, "language_model", twin)))


def _agrees(vlm: Any, twin: nn.Module) -> bool:
    from mlx_lm.models.cache import make_prompt_cache

    tokens = mx.array([PROBE_TOKENS], mx.uint32)
    try:
        theirs = vlm(tokens, cache=make_prompt_cache(vlm)).astype(mx.float32)
        ours = twin(tokens, cache=make_prompt_cache(twin)).astype(mx.float32)
    except Exception:  # noqa: BLE001 — an unexpected signature: keep decoding through mlx-vlm
        return False
    if ours.shape != theirs.shape:
        return False
    return bool((mx.abs(ours - theirs).max() <= AGREEMENT * mx.abs(theirs).max()).item())


__all__ = ["TextTwin", "load_text_twin", "twin_prefill"]
