"""/v1/embeddings over the in-process stack with the real all-MiniLM-L6-v2 (model_path: default-embedding) and the
openai client: every input form, base64 == float, dimensions, similarities, batching, limits, wrong model types."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import subprocess
import sys
from pathlib import Path
from typing import AsyncIterator

import numpy as np
import openai
import pytest

pytest.importorskip("sentence_transformers", reason="the 'embeddings' extra is not installed")

from deployments.config import ModelConfig  # noqa: E402
from deployments.embeddings.service import (  # noqa: E402
    CPU_PARALLEL_MIN_TEXTS, EmbeddingService, cpu_threads_for, default_embedding_model_path, usable_cpus,
)
from deployments.model_calls import EmbedJob  # noqa: E402
from tests.serve.local_stack import LocalStack, local_stack  # noqa: E402

EMBEDDER = "all-MiniLM-L6-v2"
DIMENSION = 384
MAX_SEQ_LENGTH = 256
REPO = Path(__file__).resolve().parents[2]


@contextlib.asynccontextmanager
async def embedding_stack(extra: list[ModelConfig] | None = None) -> AsyncIterator[tuple[LocalStack, openai.AsyncOpenAI]]:
    configs = [ModelConfig(model_path="default-embedding"), *(extra or [])]
    async with local_stack(configs) as stack:
        client = openai.AsyncOpenAI(base_url="http://orchard/v1", api_key="unused", http_client=stack.http, max_retries=0)
        yield stack, client


def _vectors(response) -> np.ndarray:
    return np.array([item.embedding for item in response.data], dtype=np.float32)


def _tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_embedding_model_path()))


def test_every_input_form_gives_unit_vectors_in_order():
    tokenizer = _tokenizer()
    ids_a = tokenizer("the cat sat on the mat", add_special_tokens=False)["input_ids"]
    ids_b = tokenizer("stock prices fell sharply", add_special_tokens=False)["input_ids"]

    async def scenario():
        async with embedding_stack() as (_, client):
            one = await client.embeddings.create(model=EMBEDDER, input="the cat sat on the mat")
            assert one.object == "list" and one.model == EMBEDDER and len(one.data) == 1
            assert one.data[0].object == "embedding" and one.data[0].index == 0 and len(one.data[0].embedding) == DIMENSION
            assert one.usage.prompt_tokens == len(ids_a) + 2 == one.usage.total_tokens  # [CLS] and [SEP] counted
            texts = await client.embeddings.create(model=EMBEDDER, input=["the cat sat on the mat", "stock prices fell sharply"])
            assert [d.index for d in texts.data] == [0, 1]
            assert texts.usage.prompt_tokens == len(ids_a) + len(ids_b) + 4
            ids = await client.embeddings.create(model=EMBEDDER, input=ids_a)
            id_lists = await client.embeddings.create(model=EMBEDDER, input=[ids_a, ids_b])
            by_text = _vectors(texts)
            np.testing.assert_allclose(np.linalg.norm(by_text, axis=1), 1.0, atol=1e-5)
            np.testing.assert_allclose(_vectors(one)[0], by_text[0], atol=1e-5)
            np.testing.assert_allclose(_vectors(ids)[0], by_text[0], atol=1e-5)
            np.testing.assert_allclose(_vectors(id_lists), by_text, atol=1e-5)
            assert id_lists.usage.prompt_tokens == texts.usage.prompt_tokens
            empty = await client.embeddings.create(model=EMBEDDER, input=["", "x"], user="someone")
            assert len(empty.data) == 2 and empty.usage.prompt_tokens == 2 + 3

    asyncio.run(scenario())


def test_base64_equals_float_and_dimensions_renormalise():
    async def scenario():
        async with embedding_stack() as (stack, client):
            text = ["a quick brown fox jumps over the lazy dog", "hello"]
            floats = _vectors(await client.embeddings.create(model=EMBEDDER, input=text, encoding_format="float"))
            raw = await stack.http.post("/v1/embeddings", json={"model": EMBEDDER, "input": text, "encoding_format": "base64"})
            assert raw.status_code == 200
            decoded = np.array([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in raw.json()["data"]])
            np.testing.assert_array_equal(decoded, floats)  # the same float32 bits
            short = _vectors(await client.embeddings.create(model=EMBEDDER, input=text, dimensions=64))
            assert short.shape == (2, 64)
            expected = floats[:, :64] / np.linalg.norm(floats[:, :64], axis=1, keepdims=True)
            np.testing.assert_allclose(short, expected, atol=1e-6)
            full = _vectors(await client.embeddings.create(model=EMBEDDER, input=text, dimensions=DIMENSION))
            np.testing.assert_array_equal(full, floats)
            too_many = await stack.http.post("/v1/embeddings", json={"model": EMBEDDER, "input": "x", "dimensions": DIMENSION + 1})
            assert too_many.status_code == 400
            error = too_many.json()["error"]
            assert error["param"] == "dimensions" and error["type"] == "invalid_request_error"
            assert "makes vectors of 384" in error["message"]
            zero = await stack.http.post("/v1/embeddings", json={"model": EMBEDDER, "input": "x", "dimensions": 0})
            assert zero.status_code == 400

    asyncio.run(scenario())


PARAPHRASES = [
    ("A man is playing a guitar.", "Someone is strumming a guitar.", "The stock market closed lower today."),
    ("How do I reset my password?", "I forgot my password, how can I change it?", "The recipe needs two eggs and flour."),
    ("The weather is sunny and warm.", "It is a bright, hot day outside.", "He parked the car in the garage."),
    ("A child is reading a book.", "A kid reads a story book.", "Interest rates were raised by the central bank."),
]


def test_paraphrases_are_closer_than_unrelated_sentences():
    async def scenario():
        async with embedding_stack() as (_, client):
            for anchor, paraphrase, unrelated in PARAPHRASES:
                a, p, u = _vectors(await client.embeddings.create(model=EMBEDDER, input=[anchor, paraphrase, unrelated]))
                assert float(a @ p) > float(a @ u) + 0.3, (anchor, float(a @ p), float(a @ u))

    asyncio.run(scenario())


def test_a_batch_and_concurrent_requests_equal_each_input_alone():
    sentences = [f"sentence number {i} says something {'rather long ' * (i % 5)}about topic {i % 3}" for i in range(16)]

    async def scenario():
        async with embedding_stack() as (stack, client):
            alone = []
            for sentence in sentences:  # one at a time: each encoded in a batch of its own
                alone.append(_vectors(await client.embeddings.create(model=EMBEDDER, input=sentence))[0])
            batch = _vectors(await client.embeddings.create(model=EMBEDDER, input=sentences))
            np.testing.assert_allclose(batch, np.array(alone), atol=1e-5)
            before = await _encode_calls(stack)
            together = await asyncio.gather(*(client.embeddings.create(model=EMBEDDER, input=s) for s in sentences))
            np.testing.assert_allclose(np.array([_vectors(r)[0] for r in together]), np.array(alone), atol=1e-5)
            batches = await _encode_calls(stack) - before
            assert 1 <= batches <= 4, batches  # 16 concurrent requests were encoded together, not one by one

    asyncio.run(scenario())


def test_a_large_cpu_encode_uses_every_core_a_lone_sentence_one_thread():
    """Ray leaves an embedding replica OMP_NUM_THREADS=1: torch would encode a batch on one core of many."""
    import torch

    assert cpu_threads_for(1, 8) == 1 and cpu_threads_for(CPU_PARALLEL_MIN_TEXTS - 1, 8) == 1
    assert cpu_threads_for(CPU_PARALLEL_MIN_TEXTS, 8) == 8 and cpu_threads_for(256, 2) == 2
    sentences = [f"sentence {i} about topic {i % 3}" for i in range(CPU_PARALLEL_MIN_TEXTS)]

    async def scenario() -> None:
        service = EmbeddingService(ModelConfig(model_path="default-embedding"))
        await service.start()
        try:
            await service._run(torch.set_num_threads, 1)  # as in a Ray replica (torch's threads are per thread)
            batch = await service.embed(EmbedJob(inputs=sentences))
            assert batch.error is None and len(batch.vectors) == CPU_PARALLEL_MIN_TEXTS
            assert await service._run(torch.get_num_threads) == usable_cpus()
            lone = await service.embed(EmbedJob(inputs=sentences[:1]))
            assert lone.error is None and await service._run(torch.get_num_threads) == 1
            np.testing.assert_allclose(np.frombuffer(lone.vectors[0], "<f4"), np.frombuffer(batch.vectors[0], "<f4"),
                                       atol=1e-5)
        finally:
            await service.shutdown()

    asyncio.run(scenario())


async def _encode_calls(stack: LocalStack) -> int:
    rows = (await stack.http.get("/v1/queue/stats")).json()["models"]
    return next(row["engine_steps_total"] for row in rows if row["id"] == EMBEDDER)


def test_admin_loads_and_unloads_the_default_embedder(tmp_path):
    async def scenario():
        async with local_stack([], tmp_path) as stack:
            loaded = await stack.http.post("/v1/admin/load-model", json={"model_path": "default-embedding"})
            assert loaded.status_code == 200 and loaded.json()["model_id"] == EMBEDDER
            assert loaded.json()["status"] == "loaded" and loaded.json()["model_type"] == "embedding"
            answer = await stack.http.post("/v1/embeddings", json={"model": EMBEDDER, "input": "hi"})  # serves now
            assert answer.status_code == 200 and len(answer.json()["data"][0]["embedding"]) == DIMENSION
            gone = await stack.http.delete(f"/v1/admin/unload-model/{EMBEDDER}")
            assert gone.status_code == 200 and gone.json()["status"] == "unloaded"

    asyncio.run(scenario())


def test_without_sentence_transformers_the_load_fails_naming_the_extra():
    """A server without the `embeddings` extra: the import fails (sys.modules entry None, in a child process)."""
    code = (
        "import asyncio, sys\n"
        "sys.modules['sentence_transformers'] = None\n"
        "from deployments.config import ModelConfig\n"
        "from deployments.ingress.local_models import LocalBackend\n"
        "from engine.errors import ModelLoadError\n"
        "try:\n"
        "    asyncio.run(LocalBackend().deploy(ModelConfig(model_path='default-embedding')))\n"
        "except ModelLoadError as exc:\n"
        "    print('REFUSED:', exc.message)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert "REFUSED: model_type 'embedding' needs sentence-transformers: install the 'embeddings' extra" in done.stdout, done.stderr


def test_limits_are_refused_naming_the_input():
    async def scenario():
        async with embedding_stack() as (stack, _):
            post = stack.http.post
            most = await post("/v1/embeddings", json={"model": EMBEDDER, "input": ["x"] * 2048})
            assert most.status_code == 200 and len(most.json()["data"]) == 2048
            over = await post("/v1/embeddings", json={"model": EMBEDDER, "input": ["x"] * 2049})
            assert over.status_code == 400
            assert "at most 2048 inputs are allowed, got 2049" in over.json()["error"]["message"]
            long_text = "word " * 300
            too_long = await post("/v1/embeddings", json={"model": EMBEDDER, "input": ["short", long_text]})
            assert too_long.status_code == 400
            error = too_long.json()["error"]
            assert error["param"] == "input.1" and error["type"] == "invalid_request_error"
            assert "input 1 has 302 tokens" in error["message"] and "at most 256" in error["message"]
            cut = await post("/v1/embeddings", json={"model": EMBEDDER, "input": ["short", long_text], "truncate": True})
            assert cut.status_code == 200 and cut.json()["usage"]["prompt_tokens"] == 3 + MAX_SEQ_LENGTH
            for body, param in [
                ({"input": []}, "input"),
                ({"input": [[1, 2], []]}, "input"),
                ({"input": [[1, 999_999]]}, "input.0"),
                ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
            ]:
                refused = await post("/v1/embeddings", json={"model": EMBEDDER, **body})
                assert refused.status_code == 400, body
                assert refused.json()["error"]["param"] == param, (body, refused.json())
            unknown = await post("/v1/embeddings", json={"model": "nobody", "input": "x"})
            assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"

    asyncio.run(scenario())


def test_wrong_model_types_are_refused_and_the_embedder_is_listed(tiny_models):
    chat = ModelConfig(model_id="alpha", model_path=str(tiny_models.alpha))

    async def scenario():
        async with embedding_stack([chat]) as (stack, client):
            with pytest.raises(openai.BadRequestError) as refused:
                await client.embeddings.create(model="alpha", input="hello")
            assert refused.value.status_code == 400
            assert refused.value.body["param"] == "model" and "model_type embedding" in refused.value.body["message"]
            for path, body in [
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                ("/v1/completions", {"prompt": "hi"}),
            ]:
                chat_to_embedder = await stack.http.post(path, json={"model": EMBEDDER, **body})
                assert chat_to_embedder.status_code == 400, path
                error = chat_to_embedder.json()["error"]
                assert error["param"] == "model" and "is an embedding model: use POST /v1/embeddings" in error["message"]
            models = (await stack.http.get("/v1/models")).json()
            assert sorted(card["id"] for card in models["data"]) == [EMBEDDER, "alpha"]
            loaded = {m["id"]: m for m in (await stack.http.get("/v1/admin/loaded-models")).json()["data"]}
            assert loaded[EMBEDDER]["type"] == "embedding" and loaded["alpha"]["type"] == "lm"
            assert loaded[EMBEDDER]["context_length"] == MAX_SEQ_LENGTH
            assert loaded[EMBEDDER]["memory"]["total_mb"] > 0

    asyncio.run(scenario())
