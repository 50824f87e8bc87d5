"""Images through the real graph (serve_config.yaml on Ray Serve, the session's shared graph): a tiny Qwen2.5-VL,
loaded as model_type multimodal, answers the official `openai` and `anthropic` clients, streamed and not, with the
image's tokens counted; the model runs in its own replica and engine process, so the images cross the ingress ->
replica -> engine boundaries."""

from __future__ import annotations

import base64

import anthropic
import openai
import pytest

from tests.graph.shared_graph import VISION as MODEL
from tests.support.vlm_images import jpeg_bytes, png_bytes

GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def base_url(shared_graph) -> str:
    """The shared graph, whose tiny-vl (a tiny Qwen2.5-VL, context 2048) is loaded as model_type multimodal."""
    return shared_graph.url


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_openai_images_streamed_and_whole(base_url):
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    content = [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{_b64(png_bytes(112, 84, seed=1))}"}},
               {"type": "text", "text": "t11 t12"},
               {"type": "image_url", "image_url": {"url": f"data:image/jpeg;base64,{_b64(jpeg_bytes(84, 84))}",
                                                  "detail": "low"}}]
    request = dict(model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=8, **GREEDY)
    whole = client.chat.completions.create(**request)
    chunks = list(client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert whole.choices[0].message.content == streamed != ""
    assert whole.usage.completion_tokens == 8 and chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens > 30
    other = client.chat.completions.create(**{**request, "messages": [{"role": "user", "content": content[1:]}]})
    assert other.usage.prompt_tokens < whole.usage.prompt_tokens  # one image fewer


def test_anthropic_image_streamed_and_whole(base_url):
    client = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    source = {"type": "base64", "media_type": "image/png", "data": _b64(png_bytes(140, 140, seed=2))}
    messages = [{"role": "user", "content": [{"type": "image", "source": source}, {"type": "text", "text": "t11"}]}]
    greedy = {"extra_body": {"temperature": 0}}  # this SDK has no sampling arguments of its own
    whole = client.messages.create(model=MODEL, max_tokens=8, messages=messages, **greedy)
    with client.messages.stream(model=MODEL, max_tokens=8, messages=messages, **greedy) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert whole.content[0].text == streamed != ""
    counted = client.messages.count_tokens(model=MODEL, messages=messages).input_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == counted > 25  # 140x140: 25 image tokens
    assert final.usage.cache_read_input_tokens > 0  # the same image a second time


def test_a_bad_image_is_a_400_across_the_graph(base_url):
    client = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
    source = {"type": "base64", "media_type": "image/png", "data": _b64(png_bytes(64, 64)[:100])}
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model=MODEL, max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "text", "text": "t1"}, {"type": "image", "source": source}]}])
    assert refused.value.body["error"]["message"].startswith("The image at messages.0.content.1 is truncated")
