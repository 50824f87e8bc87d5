"""The request body limit over the in-process stack: 413 in each API's shape, a declared length refused before any
byte is read, a chunked body refused as soon as it passes the limit, a body of exactly the limit served."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from deployments.config import ModelConfig
from deployments.ingress_config import DEFAULT_MAX_BODY_BYTES, IngressConfig
from deployments.ingress.auth import ApiKeys
from tests.serve.local_stack import local_stack

MODEL = "tiny/alpha"
LIMIT = 4096
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "t1 t2"}], "max_tokens": 2, "temperature": 0}
TOO_LARGE = f"The request body is larger than the limit of {LIMIT} bytes"


@pytest.fixture()
def alpha(tiny_models) -> ModelConfig:
    return ModelConfig(model_id=MODEL, model_path=str(tiny_models.alpha), context_length=512)


class CountingBody:
    """A request body sent in chunks (no Content-Length: chunked); counts the chunks the server pulled."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks
        self.pulled = 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            self.pulled += 1
            yield chunk


def padded_to(body: dict, size: int) -> bytes:
    """The JSON body, padded with trailing spaces (still valid JSON) to exactly `size` bytes."""
    raw = json.dumps(body).encode()
    assert len(raw) <= size
    return raw + b" " * (size - len(raw))


def test_declared_length_over_the_limit_is_refused_before_the_body_is_read(alpha):
    async def scenario():
        async with local_stack([alpha], max_body_bytes=LIMIT) as stack:
            never_read = CountingBody([b"{}"] * 4)
            refused = await stack.http.post("/v1/chat/completions", content=never_read,
                                            headers={"Content-Length": str(LIMIT + 1), "Content-Type": "application/json"})
            assert refused.status_code == 413 and never_read.pulled == 0
            assert refused.json() == {"error": {"message": TOO_LARGE, "type": "invalid_request_error", "param": None,
                                                "code": "request_too_large"}}
            anthropic = await stack.http.post("/v1/messages", content=padded_to(CHAT, LIMIT + 1),
                                              headers={"Content-Type": "application/json"})
            assert anthropic.status_code == 413
            assert anthropic.json() == {"type": "error", "error": {"type": "request_too_large", "message": TOO_LARGE}}
            # Any route: the limit is the edge's, not a route's.
            assert (await stack.http.request("GET", "/health", content=b"x" * (LIMIT + 1))).status_code == 413

    asyncio.run(scenario())


def test_chunked_body_is_refused_once_it_passes_the_limit(alpha):
    async def scenario():
        async with local_stack([alpha], max_body_bytes=LIMIT) as stack:
            body = CountingBody([b" " * 2048] * 8)  # 16 KiB in all; the limit passes on the third chunk
            refused = await stack.http.post("/v1/messages", content=body, headers={"Content-Type": "application/json"})
            assert refused.status_code == 413 and body.pulled == 3
            assert refused.json() == {"type": "error", "error": {"type": "request_too_large", "message": TOO_LARGE}}
            body = CountingBody([b" " * 2048] * 8)
            refused = await stack.http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
            assert refused.status_code == 413 and body.pulled == 3 and refused.json()["error"]["code"] == "request_too_large"
            # The stack goes on serving.
            assert (await stack.http.post("/v1/chat/completions", json=CHAT)).status_code == 200

    asyncio.run(scenario())


def test_a_body_of_exactly_the_limit_is_served(alpha):
    async def scenario():
        async with local_stack([alpha], max_body_bytes=LIMIT, keys=ApiKeys(["k"])) as stack:
            headers = {"Content-Type": "application/json", "Authorization": "Bearer k"}
            declared = await stack.http.post("/v1/chat/completions", content=padded_to(CHAT, LIMIT), headers=headers)
            assert declared.status_code == 200, declared.text
            raw = padded_to(CHAT, LIMIT)
            chunked = CountingBody([raw[:1000], raw[1000:3000], raw[3000:]])
            streamed = await stack.http.post("/v1/chat/completions", content=chunked, headers=headers)
            assert streamed.status_code == 200 and chunked.pulled == 3
            return declared.json(), streamed.json()

    declared, streamed = asyncio.run(scenario())
    assert declared["usage"]["completion_tokens"] == streamed["usage"]["completion_tokens"] == 2


def test_keys_are_checked_before_the_body_limit(alpha):
    async def scenario():
        async with local_stack([alpha], max_body_bytes=LIMIT, keys=ApiKeys(["k"])) as stack:
            body = CountingBody([b" " * 2048] * 4)
            refused = await stack.http.post("/v1/chat/completions", content=body)
            assert refused.status_code == 401 and body.pulled == 0

    asyncio.run(scenario())


def test_default_limit_is_32_mib():
    assert IngressConfig().max_body_bytes == DEFAULT_MAX_BODY_BYTES == 32 * 1024 * 1024
    assert IngressConfig(max_body_bytes=1024).max_body_bytes == 1024
    with pytest.raises(ValueError, match="max_body_bytes"):
        IngressConfig(max_body_bytes=0)
