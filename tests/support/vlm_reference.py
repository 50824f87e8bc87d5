"""mlx-vlm's own processing and greedy generation: the reference a VLM engine's output is compared with."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from PIL import Image

# Keys of a processor's output that stream_generate takes as named arguments, not as extra model inputs.
_OWN_KEYS = ("input_ids", "attention_mask", "pixel_values")


@dataclass(frozen=True)
class ProcessedChat:
    """A processor's output for one rendered chat (a batch of one row)."""

    prompt: str  # the chat template's text, image placeholders not yet expanded
    input_ids: mx.array  # (1, L) int64, image placeholders expanded to the image's tokens
    attention_mask: mx.array  # (1, L) int64
    pixel_values: mx.array | None  # None for a text-only chat
    extra: dict[str, mx.array] = field(default_factory=dict)  # Qwen: image_grid_thw (num_images, 3) int64


@dataclass(frozen=True)
class GreedyReference:
    token_ids: list[int]
    logprobs: list[mx.array]  # one (vocab,) log-softmax vector per generated token, before it was chosen
    finish_reason: str  # "stop" (an eos token, included in token_ids) or "length"

    def chosen_logprobs(self) -> list[float]:
        return [float(lp[token]) for token, lp in zip(self.token_ids, self.logprobs)]


def process_chat(processor: Any, messages: list[dict[str, Any]], images: list[Image.Image]) -> ProcessedChat:
    """Render OpenAI-style `messages` with the tokenizer's chat template, then run the processor on it.

    The template's own markers (Gemma's <bos>) are already in the text, so the tokenizer adds none.
    """
    prompt = processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    out = processor(text=[prompt], images=images or None, padding=True, add_special_tokens=False)
    return ProcessedChat(
        prompt=prompt,
        input_ids=out["input_ids"],
        attention_mask=out["attention_mask"],
        pixel_values=out.get("pixel_values"),
        extra={key: value for key, value in out.items() if key not in _OWN_KEYS},
    )


def mlx_vlm_greedy(model: Any, processor: Any, chat: ProcessedChat, max_tokens: int) -> GreedyReference:
    """mlx-vlm's `stream_generate` at temperature 0 on already processed inputs.

    Passing input_ids skips mlx-vlm's own tokenisation of a prompt string, which for Gemma 3 adds a second
    <bos> (its processor carries no chat_template, so mlx-vlm asks the tokenizer for special tokens).
    """
    from mlx_vlm import stream_generate

    results = list(stream_generate(
        model, processor, "", input_ids=chat.input_ids, pixel_values=chat.pixel_values,
        mask=chat.attention_mask, max_tokens=max_tokens, temperature=0.0, **chat.extra,
    ))
    final = results[-1]
    # One result per token, then a summary repeating the last one; an eos token appears only in the summary.
    per_token = results[:-1] + ([final] if final.finish_reason == "stop" else [])
    assert [r.token for r in per_token] == final.token_ids, "stream_generate changed its result protocol"
    return GreedyReference(token_ids=list(final.token_ids), logprobs=[r.logprobs for r in per_token],
                           finish_reason=final.finish_reason)
