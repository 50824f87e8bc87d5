"""Images in OpenAI chat, Anthropic Messages and Responses requests -> ChatPrompt (issue 27, the ingress's side):
Hugging Face content parts in place, `ChatPrompt.images` in placeholder order with each image's param, and every
refusal naming the image's part. The conversion and limit checks run here without a model; the refusals that the
ingress makes are also checked over HTTP (in process, a tiny text model behind it: none of them reaches it)."""

from __future__ import annotations

import asyncio
import base64
import random

import pytest

from deployments.api.anthropic_convert import chat_prompt, messages_job
from deployments.api.anthropic_schemas import CountTokensRequest, MessagesRequest
from deployments.api.images import (
    MessageContent,
    decode_base64,
    image_from_url,
    parse_data_url,
)
from deployments.api.openai_convert import chat_job
from deployments.api.openai_schemas import ChatCompletionRequest
from deployments.api.responses_convert import responses_job
from deployments.api.responses_schemas import INPUT_ITEMS, ResponsesRequest
from deployments.config import ModelConfig
from deployments.ingress_config import IngressConfig, MediaLimits
from deployments.ingress.media_fetch import ImageLoader, check_images
from deployments.model_calls import ChatPrompt, ImageInput, TextPrompt
from engine.errors import InvalidRequestError
from tests.serve.local_stack import local_stack
from tests.support.images import png

RED, BLUE = png(4, 3), png(2, 2, (0, 0, 255))
RED_B64, BLUE_B64 = base64.b64encode(RED).decode(), base64.b64encode(BLUE).decode()
RED_URL, BLUE_URL = f"data:image/png;base64,{RED_B64}", f"data:image/png;base64,{BLUE_B64}"
IMAGE = {"type": "image"}


def text(value: str) -> dict:
    return {"type": "text", "text": value}


def refusal(convert, *args) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as caught:
        convert(*args)
    return caught.value


# ---- data URLs and base64 ------------------------------------------------------------------------------------------
def test_data_urls_decode_to_their_bytes_and_media_type():
    assert parse_data_url(RED_URL, "p") == ("image/png", RED)
    # Case-insensitive names, parameters before base64, MIME-style line breaks in the data.
    wrapped = "\n".join(RED_B64[i:i + 8] for i in range(0, len(RED_B64), 8))
    assert parse_data_url(f"data:Image/PNG;name=x.png;BASE64,{wrapped}", "p") == ("image/png", RED)
    assert decode_base64(f" {BLUE_B64}\r\n", "p") == BLUE


def test_base64_of_every_length_and_byte_decodes_as_the_standard_library_does():
    # The SIMD decoder takes unwrapped data; what it refuses (a stray padding character) the standard library takes.
    rng = random.Random(5)
    for size in [*range(1, 70), 1 << 20]:
        data = bytes(rng.getrandbits(8) for _ in range(size)) if size < 70 else rng.randbytes(size)
        text = base64.b64encode(data).decode()
        assert decode_base64(text, "p") == data
    assert decode_base64("QUJD=", "p") == base64.b64decode("QUJD=", validate=True) == b"ABC"


@pytest.mark.parametrize("url, words", [
    (f"data:image/png;base64,{RED_B64[:-3]}", "not valid base64"),  # truncated: padding missing
    ("data:image/png;base64,iVBOR!!!", "not valid base64"),
    ("data:image/png;base64,ivb\u00e9", "non-ASCII"),
    ("data:image/png;base64,", "empty"),
    (f"data:text/plain;base64,{RED_B64}", "'text/plain', not an image type"),
    (f"data:;base64,{RED_B64}", "none, not an image type"),
    (f"data:image/;base64,{RED_B64}", "not an image type"),
    ("data:image/png,%89PNG", "not base64-encoded"),
    ("data:image/png;base64", "no ','"),
    ("file:///etc/passwd", "'file:' URLs are not accepted"),
    ("ftp://example.com/a.png", "'ftp:' URLs are not accepted"),
    (RED_B64, "bare base64"),
    ("cat.png", "without a scheme"),
])
def test_bad_image_urls_are_refused_naming_the_part(url, words):
    error = refusal(image_from_url, url, "messages.0.content.1")
    assert error.param == "messages.0.content.1" and words in error.message, error.message
    assert error.message.startswith("messages.0.content.1: ")


def test_remote_urls_wait_for_the_ingress_and_detail_is_checked():
    remote = image_from_url("HTTPS://example.com/cat.png?sig=1", "p", "low")
    assert remote == ImageInput(b"", "p", detail="low", url="HTTPS://example.com/cat.png?sig=1")
    assert image_from_url(RED_URL, "p", "original").detail == "high"  # the most a local model has
    assert "'detail' must be one of auto, low, high, original" in refusal(image_from_url, RED_URL, "p", "max").message


def test_message_content_is_todays_text_without_images_and_parts_with_them():
    images: list[ImageInput] = []
    plain = MessageContent("\n\n", ["a", "b"])
    assert plain.render(images) == "a\n\nb" and plain.render(images, "Error: ") == "Error: a\n\nb"
    red, blue = ImageInput(RED, "r"), ImageInput(BLUE, "b")
    mixed = MessageContent("\n", [red, "a", "b", blue, blue, "c"])
    assert mixed.render(images, "Error: ") == [text("Error: "), IMAGE, text("a\nb"), IMAGE, IMAGE, text("c")]
    assert images == [red, blue, blue]


# ---- OpenAI chat completions ---------------------------------------------------------------------------------------
def openai_prompt(messages: list[dict]) -> ChatPrompt:
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": messages})
    return chat_job(body, "chatcmpl-1", "log").prompt


def test_openai_image_parts_in_several_turns_in_order():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [text("Compare"), {"type": "image_url", "image_url": {"url": RED_URL}},
                                     text("and"), text("this:"),
                                     {"type": "image_url", "image_url": {"url": BLUE_URL, "detail": "low"}}]},
        {"role": "assistant", "content": "Red, then blue."},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/c.png",
                                                                          "detail": "high"}}, text("And this?")]},
    ]
    prompt = openai_prompt(messages)
    assert prompt.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [text("Compare"), IMAGE, text("and\nthis:"), IMAGE]},
        {"role": "assistant", "content": "Red, then blue."},
        {"role": "user", "content": [IMAGE, text("And this?")]},
    ]
    assert prompt.images == [
        ImageInput(RED, "messages.1.content.1", media_type="image/png"),
        ImageInput(BLUE, "messages.1.content.4", media_type="image/png", detail="low"),
        ImageInput(b"", "messages.3.content.0", detail="high", url="https://example.com/c.png"),
    ]


def test_openai_text_only_content_is_unchanged():
    messages = [{"role": "user", "content": [text("a"), text("b")]}, {"role": "assistant", "content": [text("c")]},
                {"role": "user", "content": "d"}]
    prompt = openai_prompt(messages)
    assert [m["content"] for m in prompt.messages] == ["a\nb", "c", "d"] and prompt.images == []


@pytest.mark.parametrize("part, param, words", [
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@@"}}, "messages.0.content.1", "base64"),
    ({"type": "image_url", "image_url": {"url": "file:///etc/hosts"}}, "messages.0.content.1", "'file:'"),
    ({"type": "image_url", "image_url": {"url": RED_URL, "detail": "ultra"}}, "messages.0.content.1", "detail"),
    ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, "messages.0.content.1", "input_audio"),
    ({"type": "file", "file": {"file_id": "f"}}, "messages.0.content.1", "'file' are not supported"),
])
def test_openai_refusals_name_the_part(part, param, words):
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": [text("See:"), part]}]})
    error = refusal(chat_job, body, "c", "l")
    assert error.param == param and words in error.message, error.message


# ---- Anthropic Messages ----------------------------------------------------------------------------------------------
def base64_block(data: str, media_type: str | None = "image/png") -> dict:
    source = {"type": "base64", "data": data} | ({"media_type": media_type} if media_type else {})
    return {"type": "image", "source": source}


def url_block(url: str) -> dict:
    return {"type": "image", "source": {"type": "url", "url": url}}


def anthropic_body(messages: list[dict]) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 8, "messages": messages})


def test_anthropic_images_in_user_turns_and_tool_results_in_order():
    messages = [
        {"role": "user", "content": [base64_block(RED_B64), text("What is it?")]},
        {"role": "assistant", "content": [text("Let me look."), {"type": "tool_use", "id": "t1", "name": "look",
                                                                    "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "is_error": True,
             "content": [base64_block(BLUE_B64, "image/webp"), text("blurred")]},
            text("Also"), url_block("https://example.com/c.png"), text("please.")]},
    ]
    prompt = messages_job(anthropic_body(messages), "msg_1", "log").prompt
    assert prompt.messages[0] == {"role": "user", "content": [IMAGE, text("What is it?")]}
    assert prompt.messages[2] == {"role": "tool", "tool_call_id": "t1",
                                  "content": [text("Error: "), IMAGE, text("blurred")]}
    assert prompt.messages[3] == {"role": "user", "content": [text("Also"), IMAGE, text("please.")]}
    assert prompt.images == [
        ImageInput(RED, "messages.0.content.0", media_type="image/png"),
        ImageInput(BLUE, "messages.2.content.0.content.0", media_type="image/webp"),
        ImageInput(b"", "messages.2.content.2", url="https://example.com/c.png"),
    ]
    counted = chat_prompt(CountTokensRequest.model_validate({"model": "m", "messages": messages}))
    assert counted.messages == prompt.messages and counted.images == prompt.images


@pytest.mark.parametrize("block, words", [
    (base64_block(RED_B64[:-2]), "not valid base64"),
    (base64_block(RED_B64, None), "the media type is none"),
    (base64_block(RED_B64, "application/pdf"), "'application/pdf', not an image type"),
    (url_block("file:///etc/passwd"), "'file:' URLs are not accepted"),
    ({"type": "image", "source": {"type": "file", "file_id": "file_1"}}, "Files API"),
    ({"type": "image", "source": {"type": "bytes", "data": "x"}}, "not a 'bytes' source"),
    ({"type": "image", "source": {"type": "base64", "media_type": "image/png"}}, "not a 'base64' source"),
])
def test_anthropic_image_refusals_name_the_block(block, words):
    in_user = [{"role": "user", "content": [text("See:"), block]}]
    error = refusal(messages_job, anthropic_body(in_user), "m", "l")
    assert error.param == "messages.0.content.1" and words in error.message, error.message
    in_result = [{"role": "user", "content": "x"},
                 {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [block]}]}]
    error = refusal(chat_prompt, CountTokensRequest.model_validate({"model": "m", "messages": in_result}))
    assert error.param == "messages.2.content.0.content.0" and words in error.message, error.message


def test_anthropic_images_only_where_anthropic_takes_them():
    in_assistant = [{"role": "user", "content": "x"}, {"role": "assistant", "content": [base64_block(RED_B64)]}]
    error = refusal(messages_job, anthropic_body(in_assistant), "m", "l")
    assert error.param == "messages.1.content.0" and "'image' are not allowed in this turn" in error.message


# ---- Responses -------------------------------------------------------------------------------------------------------
def input_image(url: str | None = None, **fields) -> dict:
    return {"type": "input_image", "detail": "auto", **({"image_url": url} if url else {}), **fields}


def responses_prompt(items: list[dict], history: list[dict] | None = None) -> ChatPrompt:
    body = ResponsesRequest.model_validate({"model": "m", "input": items})
    return responses_job(body, INPUT_ITEMS.validate_python(history or []), "resp_1", "log").job.prompt


def test_responses_images_in_messages_and_function_outputs_after_history():
    history = [{"role": "user", "content": [{"type": "input_text", "text": "Earlier:"}, input_image(BLUE_URL)]},
               {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Blue."}]}]
    items = [
        {"type": "function_call", "call_id": "c1", "name": "shoot", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": [input_image(RED_URL, detail="low")]},
        {"role": "user", "content": [{"type": "input_text", "text": "And"},
                                     input_image("http://example.com/x.png", detail="original")]},
    ]
    prompt = responses_prompt(items, history)
    assert prompt.messages[0] == {"role": "user", "content": [text("Earlier:"), IMAGE]}
    assert prompt.messages[2] == {"role": "tool", "tool_call_id": "c1", "content": [IMAGE], "name": "shoot"}
    assert prompt.messages[3] == {"role": "user", "content": [text("And"), IMAGE]}
    assert prompt.images == [
        ImageInput(BLUE, "previous_response_id", media_type="image/png", detail="auto"),
        ImageInput(RED, "input[1].output[0]", media_type="image/png", detail="low"),
        ImageInput(b"", "input[2].content[1]", detail="high", url="http://example.com/x.png"),
    ]


@pytest.mark.parametrize("item, param, words", [
    ({"role": "user", "content": [input_image(file_id="file_1")]}, "input[0].content[0]", "Files API"),
    ({"role": "user", "content": [input_image()]}, "input[0].content[0]", "needs 'image_url'"),
    ({"role": "user", "content": [input_image("data:image/png;base64,abc")]}, "input[0].content[0]", "base64"),
    ({"role": "user", "content": [input_image(RED_URL, detail="max")]}, "input[0].content[0]", "'detail'"),
    ({"role": "developer", "content": [input_image(RED_URL)]}, "input[0].content[0]", "'developer' messages"),
    ({"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}, "input[0].content[0]", "input_file"),
    ({"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}, "input[0].content[0]",
     "input_audio"),
])
def test_responses_refusals_name_the_part(item, param, words):
    body = ResponsesRequest.model_validate({"model": "m", "input": [item]})
    error = refusal(responses_job, body, [], "r", "l")
    assert error.param == param and words in error.message, error.message


# ---- the ingress's limits (no fetching) ------------------------------------------------------------------------------
def test_ingress_config_fields_and_defaults():
    assert IngressConfig().media_limits() == MediaLimits(False, 16, 20 * 1024 * 1024, 10.0, 3, False)
    config = IngressConfig(allow_remote_media=True, max_images_per_request=2, max_image_bytes=1000,
                           remote_media_timeout_s=1.5, remote_media_max_redirects=0, remote_media_allow_private=True)
    assert config.media_limits() == MediaLimits(True, 2, 1000, 1.5, 0, True)
    for bad in ({"max_images_per_request": -1}, {"max_image_bytes": 0}, {"remote_media_timeout_s": 0},
                {"remote_media_max_redirects": -1}, {"allow_remote_media": "sometimes"}):
        with pytest.raises(ValueError):
            IngressConfig(**bad)


def test_limits_name_the_limit_and_the_image():
    images = [ImageInput(RED, f"messages.0.content.{i}") for i in range(52)]
    error = refusal(check_images, images, MediaLimits())
    assert error.message == "52 images; this server takes at most 16 per request (max_images_per_request)"
    assert error.param == "messages.0.content.16"
    big = ImageInput(b"x" * 3_000_000, "messages.1.content.0")
    error = refusal(check_images, [ImageInput(RED, "a"), big], MediaLimits(max_image_bytes=2 * 1024 * 1024))
    assert error.param == "messages.1.content.0" and error.message == (
        "messages.1.content.0: the image is 2.9 MiB; this server takes at most 2.0 MiB per image (max_image_bytes)")
    remote = ImageInput(b"", "input[0].content[0]", url="https://user:pw@example.com/a.png?token=secret")
    error = refusal(check_images, [remote], MediaLimits())
    assert error.param == "input[0].content[0]" and "allow_remote_media: true" in error.message
    assert "https://example.com/a.png" in error.message and "secret" not in error.message and "pw" not in error.message
    check_images([ImageInput(RED, "a")] * 16, MediaLimits())  # at the limits: accepted
    check_images([remote], MediaLimits(allow_remote_media=True))


def test_loader_leaves_prompts_without_images_alone():
    loader = ImageLoader(MediaLimits(max_images_per_request=0))
    asyncio.run(loader.load(TextPrompt(text="hi")))
    asyncio.run(loader.load(ChatPrompt([{"role": "user", "content": "hi"}])))
    with pytest.raises(InvalidRequestError, match="1 image; this server takes at most 0"):
        asyncio.run(loader.load(ChatPrompt([{"role": "user", "content": [IMAGE]}], images=[ImageInput(RED, "p")])))


# ---- over HTTP: the ingress refuses before the model sees anything ---------------------------------------------------
MODEL = "tiny/alpha"


@pytest.fixture()
def alpha(tiny_models) -> ModelConfig:
    return ModelConfig(model_id=MODEL, model_path=str(tiny_models.alpha), context_length=512)


def openai_images(count: int, url: str = RED_URL) -> dict:
    parts = [text("Look:")] + [{"type": "image_url", "image_url": {"url": url}}] * count
    return {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": parts}]}


def anthropic_images(count: int, block: dict | None = None) -> dict:
    blocks = [text("Look:")] + [block or base64_block(RED_B64)] * count
    return {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": blocks}]}


def responses_images(count: int, url: str = RED_URL) -> dict:
    parts = [{"type": "input_text", "text": "Look:"}] + [input_image(url)] * count
    return {"model": MODEL, "max_output_tokens": 4, "input": [{"role": "user", "content": parts}]}


ROUTE_REFUSALS = [
    ("/v1/chat/completions", openai_images(17), "messages.0.content.17", "17 images; this server takes at most 16"),
    ("/v1/chat/completions", openai_images(1, "data:image/png;base64,iVBORw0KGgo"), "messages.0.content.1",
     "not valid base64"),
    ("/v1/chat/completions", openai_images(1, "http://127.0.0.1:9/a.png"), "messages.0.content.1",
     "allow_remote_media"),
    ("/v1/chat/completions", openai_images(1, f"data:image/png;base64,{base64.b64encode(png(64, 64)).decode()}"),
     "messages.0.content.1", "(max_image_bytes)"),
    ("/v1/messages", anthropic_images(17), "messages.0.content.17", "17 images"),
    ("/v1/messages", anthropic_images(1, base64_block(RED_B64, "text/html")), "messages.0.content.1",
     "not an image type"),
    ("/v1/messages", anthropic_images(1, url_block("https://127.0.0.1:9/a.png")), "messages.0.content.1",
     "allow_remote_media"),
    ("/v1/messages/count_tokens", anthropic_images(1, url_block("https://127.0.0.1:9/a.png")),
     "messages.0.content.1", "allow_remote_media"),
    ("/v1/messages/count_tokens", anthropic_images(17), "messages.0.content.17", "17 images"),
    ("/v1/responses", responses_images(17), "input[0].content[17]", "17 images"),
    ("/v1/responses", responses_images(1, "http://127.0.0.1:9/a.png"), "input[0].content[1]", "allow_remote_media"),
    ("/v1/responses", responses_images(1, "data:image/gif;base64,R0lGOD"), "input[0].content[1]", "base64"),
]


def test_ingress_refusals_over_http_in_each_apis_shape(alpha):
    limits = MediaLimits(max_image_bytes=len(png(64, 64)) - 1)

    async def scenario():
        async with local_stack([alpha], media=limits) as stack:
            return [await stack.http.post(path, json=body) for path, body, _, _ in ROUTE_REFUSALS]

    for (path, _, param, words), response in zip(ROUTE_REFUSALS, asyncio.run(scenario())):
        assert response.status_code == 400, (path, param, response.text)
        body = response.json()
        if path.startswith("/v1/messages"):
            assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
            assert body["error"]["message"].startswith(f"{param}: ") and words in body["error"]["message"], body
        else:
            error = body["error"]
            assert error["type"] == "invalid_request_error" and error["param"] == param, (path, error)
            assert words in error["message"], (path, error)


def test_a_missing_model_is_404_before_any_image_is_looked_at(alpha):
    async def scenario():
        async with local_stack([alpha]) as stack:
            body = {**openai_images(1, "http://127.0.0.1:9/a.png"), "model": "nope"}
            return await stack.http.post("/v1/chat/completions", json=body)

    response = asyncio.run(scenario())
    assert response.status_code == 404 and response.json()["error"]["param"] == "model"
