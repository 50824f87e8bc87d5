"""Images through the in-process stack with the real `openai` and `anthropic` clients: a tiny Qwen2.5-VL answers
images in all three APIs (streamed text == whole text), counts them, caches them; bad images get 400s naming the
image and the limit; a text model refuses an image by name."""

from __future__ import annotations

import asyncio
import base64
import struct
import zlib

import anthropic
import httpx2
import openai
import pytest

from deployments.config import ModelConfig
from deployments.model.vision_warmup import FOLLOW_UP_WORDS
from tests.serve.local_stack import local_stack, wait_for
from tests.serve.test_metrics_local import Scrape
from tests.support.tiny_vlms import write_qwen25_vl
from tests.support.vlm_images import jpeg_bytes, png_bytes, truncated_png_bytes

VL = "tiny-vl"
QUESTION = "t11 t12 t13"


@pytest.fixture(scope="module")
def vl_config(tmp_path_factory) -> ModelConfig:
    folder = write_qwen25_vl(tmp_path_factory.mktemp("vl"))
    return ModelConfig(model_path=str(folder), model_id=VL, model_type="multimodal", max_image_pixels=1_000_000,
                       advanced={"prefill_warmup_seconds": 0})


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def openai_image_message(*images: bytes, media_type: str = "image/png") -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": data_url(data, media_type)}} for data in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": QUESTION}]}]


def anthropic_image_message(data: bytes) -> list[dict]:
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(data).decode()}
    return [{"role": "user", "content": [{"type": "image", "source": source}, {"type": "text", "text": QUESTION}]}]


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims `width` x `height` with one row of pixel data: the size check must come before
    decoding (the pixels would take 1.2 GB)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    row = zlib.compress(b"\x00" + b"\x00" * 3 * width)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", row) + chunk(b"IEND", b"")


def clients(stack) -> tuple[openai.AsyncOpenAI, anthropic.AsyncAnthropic]:
    oa = openai.AsyncOpenAI(base_url="http://orchard/v1", api_key="unused", http_client=stack.http, max_retries=0)
    transport = httpx2.ASGITransport(app=stack.app)  # the anthropic SDK speaks httpx2
    an = anthropic.AsyncAnthropic(base_url="http://orchard", api_key="unused", max_retries=0,
                                  http_client=httpx2.AsyncClient(transport=transport))
    return oa, an


def test_images_in_all_three_apis_streamed_equal_whole_and_counted(vl_config, tmp_path):
    image = png_bytes(112, 84, seed=1)

    async def scenario():
        async with local_stack([vl_config], tmp_path) as stack:
            oa, an = clients(stack)
            request = dict(model=VL, messages=openai_image_message(image), max_tokens=8, temperature=0)
            whole = await oa.chat.completions.create(**request)
            stream = await oa.chat.completions.create(**request, stream=True)
            streamed = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            assert whole.choices[0].message.content == streamed != ""
            assert whole.usage.prompt_tokens > 20  # the image's tokens, expanded by the processor

            messages = anthropic_image_message(image)
            counted = await an.messages.count_tokens(model=VL, messages=messages)
            answer = await an.messages.create(model=VL, max_tokens=8, messages=messages, extra_body={"temperature": 0})
            async with an.messages.stream(model=VL, max_tokens=8, messages=messages, extra_body={"temperature": 0}) as events:
                streamed = "".join([text async for text in events.text_stream])
            assert answer.content[0].text == streamed != ""
            # Anthropic counts cache reads apart: the same image again, its blocks were cached.
            assert answer.usage.cache_read_input_tokens > 0
            assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens == counted.input_tokens

            response = await oa.responses.create(model=VL, max_output_tokens=8, temperature=0, input=[
                {"role": "user", "content": [{"type": "input_image", "image_url": data_url(image)},
                                             {"type": "input_text", "text": QUESTION}]}])
            assert response.status in ("completed", "incomplete") and response.output_text

            # One tower run: the four requests after the first merged the image's kept features. The batched
            # tower's counters (metrics and queue stats) saw that one image.
            async def lookups() -> tuple | None:
                scrape = Scrape((await stack.http.get("/metrics")).text)
                seen = tuple(scrape.values.get(("orchard:vision_feature_cache_lookups_total",
                                                (("model_name", VL), ("result", result)))) for result in ("miss", "hit"))
                seen += (scrape.values.get(("orchard:vision_tower_images_total", (("model_name", VL),))),)
                return seen if seen == (1.0, 4.0, 1.0) else None
            await wait_for(lookups, timeout_s=10)
            row = next(m for m in (await stack.http.get("/v1/queue/stats")).json()["models"] if m["id"] == VL)
            assert row["vision_tower_images_total"] == 1 and row["vision_tower_seconds_total"] > 0

    asyncio.run(scenario())


def test_warm_up_images_run_at_load_and_leave_answers_unchanged(vl_config, tmp_path):
    """vision_warmup_sizes: requests per size before the model is ready, one image with a question and its follow-ups
    (the tower ran once a size: two misses; each follow-up went as a user's repeated image goes, without its pixels,
    and took its image's kept features: a hit); a user's image then answers as on a model loaded without them."""
    warm = vl_config.model_copy(update={"vision_warmup_sizes": ["64x48", "56x56"]})
    request = dict(model=VL, messages=openai_image_message(png_bytes(64, 48, seed=9)), max_tokens=6, temperature=0)

    async def answer(config) -> tuple[str, tuple]:
        async with local_stack([config], tmp_path) as stack:
            scrape = Scrape((await stack.http.get("/metrics")).text)
            warmed = tuple(scrape.values.get(("orchard:vision_feature_cache_lookups_total",
                                              (("model_name", VL), ("result", result)))) for result in ("miss", "hit"))
            oa, _ = clients(stack)
            return (await oa.chat.completions.create(**request)).choices[0].message.content, warmed

    warm_answer, warmed = asyncio.run(answer(warm))
    cold_answer, cold = asyncio.run(answer(vl_config))
    assert warmed == (2.0, 2.0 * len(FOLLOW_UP_WORDS)) and cold in ((None, None), (0.0, 0.0))
    assert warm_answer == cold_answer != ""


BAD_IMAGES = [
    (truncated_png_bytes(), "image/png", "truncated or corrupt"),
    (png_bytes(1, 1), "image/png", "1x1 pixels; images need at least 2 pixels a side"),
    (png_header_only(20_000, 20_000), "image/png", "20000x20000 pixels; this model takes at most 1,000,000 pixels"),
    (jpeg_bytes(64, 64), "image/png", "declared as image/png but holds image/jpeg data"),
    (b"GIF89a but not really", "image/gif", "is not an image Orchard can read"),
]


def test_bad_images_get_a_400_naming_the_image(vl_config, tmp_path):
    """Each bad image in one server (a model load per case cost ~3 s each): both APIs refuse it, naming it."""
    async def scenario():
        async with local_stack([vl_config], tmp_path) as stack:
            oa, an = clients(stack)
            for data, media_type, words in BAD_IMAGES:
                messages = [{"role": "user", "content": [
                    {"type": "text", "text": QUESTION},
                    {"type": "image_url", "image_url": {"url": data_url(png_bytes(56, 56))}},
                    {"type": "image_url", "image_url": {"url": data_url(data, media_type)}}]}]
                with pytest.raises(openai.BadRequestError) as refused:
                    await oa.chat.completions.create(model=VL, messages=messages, max_tokens=4)
                error = refused.value.body
                assert error["param"] == "messages.0.content.2" and words in error["message"], error
                block = {"type": "image", "source": {"type": "base64", "media_type": media_type,
                                                     "data": base64.b64encode(data).decode()}}
                with pytest.raises(anthropic.BadRequestError) as refused:
                    await an.messages.create(model=VL, max_tokens=4, messages=[{"role": "user", "content": [block]}])
                assert words in refused.value.body["error"]["message"], (words, refused.value.body)

    asyncio.run(scenario())


def test_fifty_images_are_refused_by_the_ingress_limit(vl_config, tmp_path):
    async def scenario():
        async with local_stack([vl_config], tmp_path) as stack:
            oa, _ = clients(stack)
            with pytest.raises(openai.BadRequestError) as refused:
                await oa.chat.completions.create(model=VL, messages=openai_image_message(*[png_bytes(8, 8)] * 50))
            assert "50 images; this server takes at most 16 per request (max_images_per_request)" in refused.value.body["message"]

    asyncio.run(scenario())


def test_a_text_model_refuses_an_image_naming_it(tiny_models, tmp_path):
    config = ModelConfig(model_path=str(tiny_models.alpha), model_id="alpha", advanced={"prefill_warmup_seconds": 0})

    async def scenario():
        async with local_stack([config], tmp_path) as stack:
            oa, an = clients(stack)
            with pytest.raises(openai.BadRequestError) as refused:
                await oa.chat.completions.create(model="alpha", messages=openai_image_message(png_bytes(56, 56)))
            assert refused.value.body["param"] == "messages.0.content.0"
            assert "takes text only" in refused.value.body["message"] and "multimodal" in refused.value.body["message"]
            with pytest.raises(anthropic.BadRequestError) as refused:
                await an.messages.create(model="alpha", max_tokens=4, messages=anthropic_image_message(png_bytes(56, 56)))
            assert refused.value.body["error"]["type"] == "invalid_request_error"
            assert "takes text only" in refused.value.body["error"]["message"]

    asyncio.run(scenario())


def mp4_bytes(frames: list[bytes], fps: int = 4) -> bytes:
    """A real MP4 file (OpenCV's mp4v codec) of these PNG frames."""
    import pathlib
    import tempfile

    import cv2
    import numpy as np

    images = [cv2.imdecode(np.frombuffer(frame, np.uint8), cv2.IMREAD_COLOR) for frame in frames]
    height, width = images[0].shape[:2]
    path = pathlib.Path(tempfile.mkdtemp()) / "clip.mp4"
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, (width, height))
    for image in images:
        writer.write(image)
    writer.release()
    return path.read_bytes()


def media_tokens(folder: str, frames: int, width: int, height: int) -> int:
    """How many tokens the model's own processor gives an image (frames 1) or a video of `frames` frames."""
    import numpy as np

    from engine.vision.loader import load_vision_processor, read_media_token_ids

    processor = load_vision_processor(folder)
    image_token, video_token = read_media_token_ids(folder)
    pixels = np.zeros((height, width, 3), np.uint8)
    if frames == 1:
        from PIL import Image

        out, token = processor(text=["<|image_pad|>"], images=[Image.fromarray(pixels)]), image_token
    else:
        out, token = processor(text=["<|video_pad|>"], videos=[np.stack([pixels] * frames)]), video_token
    return int(np.count_nonzero(np.asarray(out["input_ids"]) == token))


def test_video_as_frames_or_a_file_and_never_beside_images(vl_config, tmp_path):
    frames = [png_bytes(112, 84, seed=50 + i) for i in range(8)]

    async def scenario():
        async with local_stack([vl_config], tmp_path) as stack:
            oa, _ = clients(stack)

            async def ask(part: dict) -> openai.types.chat.ChatCompletion:
                messages = [{"role": "user", "content": [part, {"type": "text", "text": QUESTION}]}]
                return await oa.chat.completions.create(model=VL, messages=messages, max_tokens=4, temperature=0)

            as_frames = await ask({"type": "video", "video": [data_url(frame) for frame in frames]})
            as_file = await ask({"type": "video_url", "video_url": {"url": data_url(mp4_bytes(frames), "video/mp4")}})
            image = await ask({"type": "image_url", "image_url": {"url": data_url(frames[0])}})
            folder = vl_config.model_path
            text_tokens = image.usage.prompt_tokens - media_tokens(folder, 1, 112, 84)
            assert as_frames.usage.prompt_tokens == text_tokens + media_tokens(folder, 8, 112, 84)
            # The file's 2 s are sampled at the processor's 2 frames a second: 4 frames.
            assert as_file.usage.prompt_tokens == text_tokens + media_tokens(folder, 4, 112, 84)
            both = [{"type": "image_url", "image_url": {"url": data_url(frames[0])}},
                    {"type": "video", "video": [data_url(frame) for frame in frames]}]
            with pytest.raises(openai.BadRequestError) as refused:
                await oa.chat.completions.create(model=VL, messages=[{"role": "user", "content": both}], max_tokens=4)
            assert refused.value.body["param"] == "messages.0.content.1" and "not both" in refused.value.body["message"]
            with pytest.raises(openai.BadRequestError) as refused:
                await ask({"type": "video_url", "video_url": {"url": data_url(b"not a video at all", "video/mp4")}})
            assert "could not be read" in refused.value.body["message"] or "no frames" in refused.value.body["message"]

    asyncio.run(scenario())


def test_detail_low_shrinks_a_large_image_to_512_pixels_a_side():
    from deployments.chat.images import decode_image
    from deployments.model_calls import ImageInput

    big = png_bytes(1024, 768)
    assert decode_image(ImageInput(big, "p", detail="low")).image.size == (512, 384)
    assert decode_image(ImageInput(big, "p", detail="high")).image.size == (1024, 768)
    assert decode_image(ImageInput(png_bytes(300, 200), "p", detail="low")).image.size == (300, 200)
