"""/v1/images/generations and /v1/images/edits over the in-process stack with the `openai` client, on a tiny random
FLUX.2 [klein] (tests/support/tiny_images.py): seeds, n, formats, streaming with progress, masks, and every refusal."""

from __future__ import annotations

import asyncio
import base64
import io

import openai
import pytest
from PIL import Image

from deployments.config import ModelConfig
from tests.serve.local_stack import local_stack

STEPS = {"steps": 2}


def _configs(tiny_klein, tiny_models) -> list[ModelConfig]:
    return [ModelConfig(model_id="klein", model_path=str(tiny_klein), model_type="image-generation",
                        config_name="flux2-klein-4b", max_images_per_request=2, max_image_batch=2),
            ModelConfig(model_id="klein-edit", model_path=str(tiny_klein), model_type="image-edit",
                        config_name="flux2-klein-edit-4b"),
            ModelConfig(model_id="alpha", model_path=str(tiny_models.alpha))]


def _client(stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://orchard/v1", api_key="unused", http_client=stack.http, max_retries=0)


def _image(b64: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(b64)))


def _png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def stack_configs(tiny_klein, tiny_models):
    return _configs(tiny_klein, tiny_models)


def test_seeded_images_repeat_in_every_format_and_stream_with_their_progress(stack_configs):
    async def scenario():
        async with local_stack(stack_configs) as stack:
            client = _client(stack)
            two = await client.images.generate(model="klein", prompt="a puffin", size="64x64", n=2,
                                               extra_body={"seed": 5, **STEPS})
            again = await client.images.generate(model="klein", prompt="a puffin", size="64x64",
                                                 extra_body={"seed": 6, **STEPS})
            jpeg = await client.images.generate(model="klein", prompt="a puffin", size="96x64", output_format="jpeg",
                                                extra_body={"seed": 5, **STEPS})
            events = [event async for event in await client.images.generate(
                model="klein", prompt="a puffin", size="64x64", stream=True, extra_body={"seed": 5, **STEPS})]
            async with stack.http.stream("POST", "/v1/images/generations", json={
                    "model": "klein", "prompt": "a puffin", "size": "64x64", "stream": True, "seed": 5, **STEPS}) as raw:
                lines = [line async for line in raw.aiter_lines()]
            return two, again, jpeg, events, lines

    two, again, jpeg, events, lines = asyncio.run(scenario())
    assert len(two.data) == 2 and all(_image(d.b64_json).size == (64, 64) for d in two.data)
    assert two.data[1].b64_json == again.data[0].b64_json  # image i of n uses seed + i; batched == alone
    assert two.data[0].b64_json != two.data[1].b64_json
    assert two.output_format == "png" and two.size == "64x64" and two.usage.output_tokens == 4
    assert _image(jpeg.data[0].b64_json).format == "JPEG" and _image(jpeg.data[0].b64_json).size == (96, 64)
    assert [event.type for event in events] == ["image_generation.completed"]
    assert events[0].b64_json == two.data[0].b64_json  # streamed == not streamed
    assert ": image 1 of 1, step 1 of 2" in lines and ": image 1 of 1, step 2 of 2" in lines


def test_an_edit_keeps_what_its_mask_covers_and_changes_the_rest(stack_configs):
    source = Image.new("RGB", (64, 64), (200, 30, 30))
    opaque = Image.new("RGBA", (64, 64), (0, 0, 0, 255))
    clear = Image.new("RGBA", (64, 64), (0, 0, 0, 0))

    async def scenario():
        async with local_stack(stack_configs) as stack:
            client = _client(stack)
            edit = lambda mask: client.images.edit(  # noqa: E731
                model="klein-edit", image=("source.png", _png(source), "image/png"), prompt="make it dusk",
                size="64x64", mask=("mask.png", _png(mask), "image/png"), extra_body={"seed": 3, **STEPS})
            return await edit(opaque), await edit(clear)

    kept, changed = asyncio.run(scenario())
    assert _image(kept.data[0].b64_json).convert("RGB").tobytes() == source.tobytes()
    assert _image(changed.data[0].b64_json).convert("RGB").tobytes() != source.tobytes()


def test_every_bad_request_is_a_400_naming_its_field(stack_configs):
    source = _png(Image.new("RGB", (64, 64)))
    small_mask = _png(Image.new("RGBA", (32, 32)))

    async def scenario():
        async with local_stack(stack_configs) as stack:
            post = stack.http.post
            base = {"model": "klein", "prompt": "a puffin", "size": "64x64", "steps": 2}
            return {
                "size": await post("/v1/images/generations", json=base | {"size": "100x100"}),
                "n": await post("/v1/images/generations", json=base | {"n": 11}),
                "max_images_per_request": await post("/v1/images/generations", json=base | {"n": 3}),
                "response_format": await post("/v1/images/generations", json=base | {"response_format": "url"}),
                "background": await post("/v1/images/generations", json=base | {"background": "transparent"}),
                "negative_prompt": await post("/v1/images/generations", json=base | {"negative_prompt": "blur"}),
                "image-to-text-model": await post("/v1/images/edits", data=base,
                                                  files={"image": ("a.png", source, "image/png")}),
                "no image": await post("/v1/images/edits", data=base | {"model": "klein-edit"},
                                       files={"mask": ("m.png", small_mask, "image/png")}),
                "not multipart": await post("/v1/images/edits", data=base | {"model": "klein-edit"}),
                "form n": await post("/v1/images/edits", data=base | {"model": "klein-edit", "n": 11},
                                     files={"image": ("a.png", source, "image/png")}),
                "mask": await post("/v1/images/edits", data=base | {"model": "klein-edit"},
                                   files=[("image", ("a.png", source, "image/png")),
                                          ("mask", ("m.png", small_mask, "image/png"))]),
                "unreadable": await post("/v1/images/edits", data=base | {"model": "klein-edit"},
                                         files={"image": ("a.png", b"not an image", "image/png")}),
                "edit model on generations": await post("/v1/images/generations", json=base | {"model": "klein-edit"}),
                "chat model": await post("/v1/images/generations", json=base | {"model": "alpha"}),
                "chat on an image model": await post("/v1/chat/completions", json={
                    "model": "klein", "messages": [{"role": "user", "content": "hi"}]}),
            }

    answers = asyncio.run(scenario())
    said = {
        "size": "'size' '100x100' is not served", "n": "less than or equal to 10",
        "max_images_per_request": "at most 2 images a request (max_images_per_request)",
        "response_format": "hosts no image files", "background": "paint opaque images",
        "negative_prompt": "take none", "image-to-text-model": "generates images from text",
        "no image": "An edit needs 'image'", "not multipart": "send the edit as multipart/form-data",
        "form n": "Invalid request: n: Input should be less than or equal to 10", "mask": "'mask' is 32x32 but 'image' is 64x64",
        "unreadable": "The image at image is not an image Orchard can read", "edit model on generations": "An edit needs 'image'",
        "chat model": "is a lm model: the image routes need", "chat on an image model": "is a image-generation model",
    }
    for case, answer in answers.items():
        assert answer.status_code == 400, (case, answer.text)
        assert said[case] in answer.json()["error"]["message"], (case, answer.text)


def test_an_image_model_loads_over_the_admin_api_and_serves(tiny_klein, tiny_models):
    async def scenario():
        async with local_stack([ModelConfig(model_id="alpha", model_path=str(tiny_models.alpha))],
                               model_roots=[str(tiny_klein.parent)]) as stack:
            loaded = await stack.http.post("/v1/admin/load-model", json={
                "model_id": "klein", "model_path": str(tiny_klein), "model_type": "image-generation",
                "config_name": "flux2-klein-4b"})
            listed = (await stack.http.get("/v1/admin/loaded-models")).json()["data"]
            made = await _client(stack).images.generate(model="klein", prompt="a puffin", size="64x64",
                                                        extra_body={"seed": 1, "steps": 1})
            return loaded, listed, made

    loaded, listed, made = asyncio.run(scenario())
    assert loaded.status_code == 200 and loaded.json()["status"] == "loaded", loaded.text
    assert {m["id"]: m["type"] for m in listed}["klein"] == "image-generation"
    assert _image(made.data[0].b64_json).size == (64, 64)
