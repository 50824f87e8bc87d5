"""Embeddings through the real graph (serve_config.yaml's ingress and embedder on Ray Serve, in the session's shared
graph): the embedded all-MiniLM-L6-v2 as its own application (model_path: default-embedding): the openai client's
embeddings.create over HTTP, the model's type in loaded-models, a chat request refused, and concurrent requests
batched (fewer encode calls, same vectors)."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import openai
import pytest

pytest.importorskip("sentence_transformers", reason="the 'embeddings' extra is not installed")

from tests.graph.shared_graph import EMBEDDER as MODEL  # noqa: E402

CONCURRENT_REQUESTS = 128


@pytest.fixture(scope="module")
def base_url(shared_graph) -> str:
    """The shared graph, whose embedder is serve_config.yaml's own entry (model_path: default-embedding)."""
    return shared_graph.url


def test_openai_embeddings_in_every_input_form(base_url):
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    texts = ["A man is playing a guitar.", "Someone is strumming a guitar.", "The stock market closed lower today."]
    by_text = np.array([d.embedding for d in client.embeddings.create(model=MODEL, input=texts).data])
    assert by_text.shape == (3, 384)
    assert float(by_text[0] @ by_text[1]) > float(by_text[0] @ by_text[2]) + 0.3
    one = client.embeddings.create(model=MODEL, input=texts[0])
    np.testing.assert_allclose(one.data[0].embedding, by_text[0], atol=1e-5)
    ids = [[101 + i for i in range(5)], [2000, 2001]]  # token ids of the model's vocabulary
    from_ids = client.embeddings.create(model=MODEL, input=ids)
    from_lone_ids = client.embeddings.create(model=MODEL, input=ids[0])
    assert len(from_ids.data) == 2 and from_ids.usage.prompt_tokens > 0
    np.testing.assert_allclose(from_lone_ids.data[0].embedding, from_ids.data[0].embedding, atol=1e-5)
    short = client.embeddings.create(model=MODEL, input=texts, dimensions=32)
    assert all(len(d.embedding) == 32 for d in short.data)
    with httpx.Client(base_url=base_url, timeout=60) as http:
        chat = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 400 and chat.json()["error"]["param"] == "model"
        assert "is an embedding model" in chat.json()["error"]["message"]


def encode_calls(http: httpx.Client) -> int:
    """The embedder's encode calls so far (its engine_steps_total in /v1/queue/stats)."""
    response = http.get("/v1/queue/stats")
    assert response.status_code == 200
    return next(row for row in response.json()["models"] if row["id"] == MODEL)["engine_steps_total"]


def test_concurrent_requests_are_batched(base_url):
    """Counted, not timed (wall times on a shared CI box are noise; bench/embeddings_throughput.py times them):
    one at a time, every request is an encode call of its own; all at once, they share a few calls, and each
    gets the vector it gets alone."""
    sentences = [f"sentence {i}: the quick brown fox jumps over the lazy dog" for i in range(CONCURRENT_REQUESTS)]

    async def embed(client: openai.AsyncOpenAI, text: str) -> np.ndarray:
        return np.array((await client.embeddings.create(model=MODEL, input=text)).data[0].embedding)

    async def one_at_a_time() -> list[np.ndarray]:
        async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300) as client:
            return [await embed(client, s) for s in sentences]

    async def all_at_once() -> list[np.ndarray]:
        async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300) as client:
            return list(await asyncio.gather(*(embed(client, s) for s in sentences)))

    with httpx.Client(base_url=base_url, timeout=60) as http:
        before = encode_calls(http)
        alone = asyncio.run(one_at_a_time())
        sequential_calls = encode_calls(http) - before
        before = encode_calls(http)
        together = asyncio.run(all_at_once())
        concurrent_calls = encode_calls(http) - before
    print(f"{CONCURRENT_REQUESTS} requests: {sequential_calls} encode calls one at a time, {concurrent_calls} at once")
    assert sequential_calls == CONCURRENT_REQUESTS
    # Seen here: 4-8 calls for 256 requests. A batch closes 5 ms after its first request, then gathers while the previous one encodes.
    assert 1 <= concurrent_calls <= CONCURRENT_REQUESTS // 4
    np.testing.assert_allclose(np.stack(together), np.stack(alone), atol=1e-5)
