"""Logits at chosen positions only: the backbone's hidden states, gathered, then the output head.

A prefill needs each completing row's last-position logits, but an mlx-lm `Model` call computes
the head over every position: [32, 512, 152k] bf16 logits are 5 GB, so the runner wrote the
bodies first and ran each row's last token as a second, decode-sized forward (~12 ms on an H100
for 32 rows, whatever their length). Most mlx-lm models are `head(self.model(inputs, cache))`,
the head being `lm_head` or the tied embedding; for those the head runs on the gathered rows.
A model is split only where its family is known to be exactly that and a probe forward agrees
bit for bit with the model's own call; any other model keeps full logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

# mlx-lm model modules whose Model.__call__ is `head(self.model(inputs, cache, ...))`, nothing more
# (gemma2's softcap, granite's logit scaling and cohere's logit scale are not, and stay whole).
SPLIT_FAMILIES = frozenset({
    "llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "phi3", "gemma", "smollm3", "olmo2", "mixtral",
    "starcoder2",
})
PROBE_TOKENS = (1, 2, 3, 4, 5, 6, 7, 8)


@dataclass(frozen=True)
class HeadSplit:
    backbone: Callable[..., mx.array] = field(repr=False)  # (inputs, cache=...) -> final hidden states
    head: Callable[[mx.array], mx.array] = field(repr=False)  # hidden states [..., hidden] -> logits


def head_split(model: Any) -> HeadSplit | None:
    """The model as backbone + head where that is exactly its call, else None."""
    family = type(model).__module__.rpartition(".")[2]
    backbone = getattr(model, "model", None)
    if family not in SPLIT_FAMILIES or not callable(backbone):
        return None
    if "lm_head" in model:
        head = model.lm_head
    elif hasattr(getattr(backbone, "embed_tokens", None), "as_linear"):
        head = backbone.embed_tokens.as_linear
    else:
        return None
    split = HeadSplit(backbone, head)
    return split if agrees(model, split) else None


def agrees(model: Any, split: HeadSplit) -> bool:
    """The split's logits equal the model call's on a probe forward (same shapes, so same kernels)."""
    tokens = mx.array([PROBE_TOKENS], mx.uint32)
    try:
        whole = model(tokens, cache=make_prompt_cache(model))
        parts = split.head(split.backbone(tokens, cache=make_prompt_cache(model)))
        return whole.shape == parts.shape and bool(mx.array_equal(whole, parts).item())
    except Exception:  # an unexpected signature or structure: keep the model whole
        return False


def logits_at(
    model: Any, split: HeadSplit | None, tokens: mx.array, cache: Any, rows: list[int], positions: list[int]
) -> mx.array:
    """Forward `tokens` [rows, width] through `cache`; the logits of (rows[i], positions[i]), [n, vocab]."""
    index = (mx.array(rows), mx.array(positions))
    if split is None:
        return model(tokens, cache=cache)[index]
    return split.head(split.backbone(tokens, cache=cache)[index])


__all__ = ["HeadSplit", "head_split", "logits_at"]
