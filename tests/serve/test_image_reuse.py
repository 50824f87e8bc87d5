"""A repeated image skips decoding and the processor (deployments/chat/processed_images.py): the prompt it makes
equals the processor's own (token ids, pixels, arrays, cache keys) for any new question; images sent otherwise
(other bytes, order, detail or declared type) are processed again; a processor whose placeholders the text alone
does not expand the same way (Gemma 3 inserts its image tokens itself) is never reused."""

from __future__ import annotations

import numpy as np
import pytest

from deployments.chat.processed_images import ProcessedImages, expanded_ids
from deployments.chat.vision_prompts import MediaTokens, VisionPromptEncoder
from deployments.model_calls import ImageInput
from engine.vision.loader import load_vision_processor, read_media_token_ids
from tests.support.tiny_vlms import write_gemma3, write_qwen25_vl
from tests.support.vlm_images import png_bytes

GIB = 1 << 30


class Encoders:
    def __init__(self, folder, reuse_bytes: int = GIB) -> None:
        self.processor = load_vision_processor(folder)
        self.tokens = MediaTokens(*read_media_token_ids(folder))
        self.reusing = VisionPromptEncoder(self.processor, self.tokens, 10**7, reuse_bytes)
        self.plain = VisionPromptEncoder(self.processor, self.tokens, 10**7)

    def text(self, question: str, images: int = 1) -> str:
        content = [{"type": "image"}] * images + [{"type": "text", "text": question}]
        return self.processor.tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> Encoders:
    return Encoders(write_qwen25_vl(tmp_path_factory.mktemp("qwen")))


def image(data: bytes, detail=None, media_type="image/png") -> ImageInput:
    return ImageInput(data, "messages.0.content.0", media_type, detail)


def assert_same_prompt(ours, theirs) -> None:
    assert ours.token_ids == theirs.token_ids and ours.cache_keys == theirs.cache_keys
    assert ours.vision.image_digests == theirs.vision.image_digests
    assert np.array_equal(ours.vision.pixel_values, theirs.vision.pixel_values)
    assert ours.vision.model_arrays.keys() == theirs.vision.model_arrays.keys()
    for name, value in theirs.vision.model_arrays.items():
        assert np.array_equal(ours.vision.model_arrays[name], value), name


def test_a_repeated_image_makes_the_processors_own_prompt_for_a_new_question(qwen):
    one = [image(png_bytes(112, 84, seed=1))]
    first = qwen.reusing.encode(qwen.text("t1 t2"), one)
    assert not first.images_repeated
    for question in ("t5 t6 t7 t8 t9", "t3"):
        again = qwen.reusing.encode(qwen.text(question), one)
        assert again.images_repeated
        assert_same_prompt(again, qwen.plain.encode(qwen.text(question), one))
    a, b = image(png_bytes(84, 84, seed=2)), image(png_bytes(56, 112, seed=3))
    qwen.reusing.encode(qwen.text("t1", 2), [a, b])
    both = qwen.reusing.encode(qwen.text("t4 t4", 2), [a, b])
    assert both.images_repeated
    assert_same_prompt(both, qwen.plain.encode(qwen.text("t4 t4", 2), [a, b]))
    swapped = qwen.reusing.encode(qwen.text("t4 t4", 2), [b, a])  # another order is other images
    assert not swapped.images_repeated
    assert_same_prompt(swapped, qwen.plain.encode(qwen.text("t4 t4", 2), [b, a]))


def test_images_sent_otherwise_are_processed_again(qwen):
    data = png_bytes(112, 84, seed=4)
    qwen.reusing.encode(qwen.text("t1"), [image(data)])
    low = qwen.reusing.encode(qwen.text("t1"), [image(data, detail="low")])
    assert not low.images_repeated
    assert_same_prompt(low, qwen.plain.encode(qwen.text("t1"), [image(data, detail="low")]))
    with pytest.raises(Exception, match="declared as image/jpeg but holds image/png"):
        qwen.reusing.encode(qwen.text("t1"), [image(data, media_type="image/jpeg")])
    other = qwen.reusing.encode(qwen.text("t1"), [image(png_bytes(112, 84, seed=5))])
    assert not other.images_repeated


def test_the_budget_keeps_the_latest_images_and_zero_keeps_none(qwen):
    images = [image(png_bytes(84, 84, seed=10 + i)) for i in range(3)]
    vision = qwen.plain.encode(qwen.text("t1"), images[:1]).vision
    one_image = ProcessedImages(vision.pixel_values, vision.model_arrays, vision.image_digests).nbytes
    small = VisionPromptEncoder(qwen.processor, qwen.tokens, 10**7, 2 * one_image)
    for picture in images:
        small.encode(qwen.text("t1"), [picture])
    # The first was let go for the third; the last used go last.
    assert [small.encode(qwen.text("t2"), [images[i]]).images_repeated for i in (2, 1, 0)] == [True, True, False]
    none = VisionPromptEncoder(qwen.processor, qwen.tokens, 10**7, 0)
    none.encode(qwen.text("t1"), images[:1])
    assert not none.encode(qwen.text("t2"), images[:1]).images_repeated


def test_a_processor_that_inserts_its_image_tokens_itself_is_never_reused(tmp_path):
    gemma = Encoders(write_gemma3(tmp_path / "gemma"))
    one = [image(png_bytes(112, 84, seed=6))]
    gemma.reusing.encode(gemma.text("t1"), one)
    again = gemma.reusing.encode(gemma.text("t2 t3"), one)
    assert not again.images_repeated
    assert_same_prompt(again, gemma.plain.encode(gemma.text("t2 t3"), one))


def test_placeholders_expand_one_per_image_in_order():
    assert expanded_ids([1, 9, 2, 9, 3], 9, [2, 3]) == [1, 9, 9, 2, 9, 9, 9, 3]
    assert expanded_ids([1, 9, 2], 9, [2, 3]) is None
