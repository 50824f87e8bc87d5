"""The tiny VLM fixtures load and generate through mlx-vlm itself, and images reach the model."""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import pytest
from PIL import Image

from tests.support.tiny_vlms import (
    GEMMA3_IMAGE_TOKEN_ID,
    GEMMA3_IMAGE_TOKENS,
    QWEN25_VL_IMAGE_TOKEN_ID,
    write_gemma3,
    write_qwen25_vl,
)
from tests.support.vlm_images import jpeg_bytes, png_bytes, truncated_png_bytes
from tests.support.vlm_reference import mlx_vlm_greedy, process_chat
from tests.support.vlm_tokenizers import GEMMA3_SPECIAL_TOKENS, QWEN25_VL_SPECIAL_TOKENS

MAX_TOKENS = 8


@dataclass(frozen=True)
class LoadedVlm:
    family: str
    model: Any
    processor: Any
    image_token_id: int
    special_tokens: dict[int, str]


@pytest.fixture(scope="module", params=["qwen2_5_vl", "gemma3"])
def vlm(request, tmp_path_factory) -> LoadedVlm:
    from mlx_vlm.utils import load

    family = request.param
    if family == "qwen2_5_vl":
        folder = write_qwen25_vl(tmp_path_factory.mktemp("qwen25-vl"))
        image_token_id, specials = QWEN25_VL_IMAGE_TOKEN_ID, QWEN25_VL_SPECIAL_TOKENS
    else:
        folder = write_gemma3(tmp_path_factory.mktemp("gemma3"))
        image_token_id, specials = GEMMA3_IMAGE_TOKEN_ID, GEMMA3_SPECIAL_TOKENS
    model, processor = load(str(folder))
    return LoadedVlm(family, model, processor, image_token_id, specials)


def image(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data))


def ask(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": list(parts)}]


IMAGE = {"type": "image"}


def text(value: str) -> dict[str, str]:
    return {"type": "text", "text": value}


def test_special_tokens_sit_at_their_real_ids_and_text_round_trips(vlm):
    tokenizer = vlm.processor.tokenizer
    for token_id, token in vlm.special_tokens.items():
        assert tokenizer.convert_tokens_to_ids(token) == token_id
        assert tokenizer.encode(token, add_special_tokens=False) == [token_id]
    phrase = "Describe the picture, s'il vous plaît: 3 dogs?\n"
    assert tokenizer.decode(tokenizer.encode(phrase, add_special_tokens=False)) == phrase
    assert tokenizer.decode([12345, 67890]) != ""  # every id decodes to something


def test_multi_turn_chat_renders_through_the_real_template(vlm):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [IMAGE, text("What is this?")]},
        {"role": "assistant", "content": [text("A cat.")]},
        {"role": "user", "content": [text("And this?"), IMAGE]},
    ]
    rendered = vlm.processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = {
        "qwen2_5_vl": (
            "<|im_start|>system\nBe brief.<|im_end|>\n"
            "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is this?<|im_end|>\n"
            "<|im_start|>assistant\nA cat.<|im_end|>\n"
            "<|im_start|>user\nAnd this?<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n"
            "<|im_start|>assistant\n"
        ),
        "gemma3": (
            "<bos><start_of_turn>user\nBe brief.\n\n<start_of_image>What is this?<end_of_turn>\n"
            "<start_of_turn>model\nA cat.<end_of_turn>\n"
            "<start_of_turn>user\nAnd this?<start_of_image><end_of_turn>\n"
            "<start_of_turn>model\n"
        ),
    }[vlm.family]
    assert rendered == expected


# (width, height) -> image tokens: Qwen's smart_resize between 56x56 and 224x224 pixels (28 px per token);
# Gemma 3 resizes every image to 112x112, pooled to 16 tokens.
QWEN_IMAGE_TOKENS = {(56, 56): 4, (28, 28): 4, (224, 224): 64, (300, 200): 54, (1000, 1000): 64}


@pytest.mark.parametrize("size", list(QWEN_IMAGE_TOKENS))
def test_prompt_holds_the_image_tokens_for_the_image_size(vlm, size):
    width, height = size
    chat = process_chat(vlm.processor, ask(IMAGE, text("Hi")), [image(png_bytes(width, height))])
    ids = chat.input_ids[0].tolist()
    if vlm.family == "qwen2_5_vl":
        expected = QWEN_IMAGE_TOKENS[size]
        grid = chat.extra["image_grid_thw"]
        assert grid.dtype == mx.int64 and grid.tolist()[0][0] == 1 and grid[0].prod().item() == 4 * expected
        assert chat.pixel_values.shape == (4 * expected, 3 * 2 * 14 * 14)  # patches x (C * T * 14 * 14)
        start = ids.index(151652)  # <|vision_start|>, then the pads, then <|vision_end|>
        assert ids[start + 1 + expected] == 151653
    else:
        expected = GEMMA3_IMAGE_TOKENS
        assert chat.extra == {}
        assert chat.pixel_values.shape == (1, 3, 112, 112)
        start = ids.index(255999)  # <start_of_image>, the soft tokens, <end_of_image>
        assert ids[start + 1 + expected] == 256000
        assert ids.count(2) == 1  # the template's <bos> only
    assert ids.count(vlm.image_token_id) == expected
    assert chat.pixel_values.dtype == mx.float32 and chat.input_ids.dtype == mx.int64


def test_greedy_generation_sees_the_image(vlm):
    question = ask(IMAGE, text("Describe the picture."))
    first = process_chat(vlm.processor, question, [image(png_bytes(56, 56, seed=1))])
    other = process_chat(vlm.processor, question, [image(png_bytes(56, 56, seed=2))])
    assert first.input_ids.tolist() == other.input_ids.tolist()  # only the pixels differ

    result = mlx_vlm_greedy(vlm.model, vlm.processor, first, MAX_TOKENS)
    assert result.finish_reason == "length" and len(result.token_ids) == MAX_TOKENS
    assert len(set(result.token_ids)) > 1  # the random weights do not just repeat one token
    assert all(-30 < lp < 0 for lp in result.chosen_logprobs())
    assert all(int(mx.argmax(lp)) == token for token, lp in zip(result.token_ids, result.logprobs))

    again = mlx_vlm_greedy(vlm.model, vlm.processor, first, MAX_TOKENS)
    assert again.token_ids == result.token_ids
    assert mx.array_equal(mx.stack(again.logprobs), mx.stack(result.logprobs))

    changed = mlx_vlm_greedy(vlm.model, vlm.processor, other, MAX_TOKENS)
    assert mx.abs(changed.logprobs[0] - result.logprobs[0]).max().item() > 1e-2


def test_greedy_generation_on_a_jpeg_of_another_size(vlm):
    chat = process_chat(vlm.processor, ask(text("What is in it?"), IMAGE), [image(jpeg_bytes(300, 200, seed=3))])
    result = mlx_vlm_greedy(vlm.model, vlm.processor, chat, MAX_TOKENS)
    assert len(result.token_ids) == MAX_TOKENS and len(set(result.token_ids)) > 1


def test_text_only_generation(vlm):
    chat = process_chat(vlm.processor, [{"role": "user", "content": "Tell me a story."}], [])
    assert chat.pixel_values is None and chat.extra == {}
    assert vlm.image_token_id not in chat.input_ids[0].tolist()
    result = mlx_vlm_greedy(vlm.model, vlm.processor, chat, MAX_TOKENS)
    assert len(result.token_ids) == MAX_TOKENS and len(set(result.token_ids)) > 1
    # mlx-vlm's own path from a prompt string gives the same tokens when it tokenises the same ids.
    from mlx_vlm import generate

    plain = generate(vlm.model, vlm.processor, chat.prompt, max_tokens=MAX_TOKENS, temperature=0.0)
    extra_bos = 1 if vlm.family == "gemma3" else 0  # mlx-vlm tokenises Gemma 3's prompt with a second <bos>
    assert plain.prompt_tokens == chat.input_ids.shape[1] + extra_bos
    if not extra_bos:
        assert plain.token_ids == result.token_ids


def test_image_helpers_make_real_files():
    from mlx_vlm.utils import load_image

    png = image(png_bytes(30, 20, seed=4))
    assert (png.format, png.size, png.mode) == ("PNG", (30, 20), "RGB")
    jpeg = image(jpeg_bytes(40, 10))
    assert (jpeg.format, jpeg.size) == ("JPEG", (40, 10))
    assert png_bytes(8, 8, seed=1) != png_bytes(8, 8, seed=2)
    broken = truncated_png_bytes()
    assert image(broken).format == "PNG"  # the header parses...
    with pytest.raises(OSError):
        image(broken).load()  # ...the pixels do not
    with pytest.raises(ValueError):
        load_image(io.BytesIO(b"not an image"))
