"""Per-request LoRA adapters over HTTP with the real openai client, in process: 'MODEL:NAME' ids listed with their
parent, chosen per request, mixed in one batch, each the same as that adapter fused into the model at load
(Bodega's lora_paths); admin load-adapter / unload-adapter with the model folders' rules."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from deployments.config import ModelConfig
from engine.models.loader import load_model
from tests.serve.local_stack import local_stack
from tests.support.tiny_adapters import random_lora, write_mlx_lm_adapter, write_peft_adapter

MODEL = "tiny"
PROMPTS = ["t5 t9 t13", "t200 t7", "t42 t42 t43 t44", "t1"]


@dataclass(frozen=True)
class Adapters:
    model: Path
    root: Path  # the admin loads' model_roots
    a0: Path
    a1: Path
    spare: Path  # for the admin load
    dora: Path


@pytest.fixture(scope="module")
def adapters(tiny_models, tmp_path_factory) -> Adapters:
    root, model = tmp_path_factory.mktemp("lora-roots"), load_model(tiny_models.alpha).model
    dora = write_peft_adapter(root / "dora", random_lora(model, 4, 9), alpha=8, use_dora=True)
    return Adapters(tiny_models.alpha, root, write_mlx_lm_adapter(root / "a0", random_lora(model, 4, 1), scale=2.0),
                    write_peft_adapter(root / "a1", random_lora(model, 8, 2), alpha=16),
                    write_mlx_lm_adapter(root / "spare", random_lora(model, 4, 3), scale=2.0), dora)


def config(folders: Adapters, **fields) -> ModelConfig:
    return ModelConfig(model_id=MODEL, model_path=str(folders.model), **fields)


async def greedy(client: openai.AsyncOpenAI, model: str, prompt: str, stream: bool = False) -> str:
    body = dict(model=model, messages=[{"role": "user", "content": prompt}], max_tokens=8, temperature=0)
    if not stream:
        return (await client.chat.completions.create(**body)).choices[0].message.content
    chunks = [c async for c in await client.chat.completions.create(**body, stream=True)]
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def openai_client(stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://orchard/v1", api_key="unused", http_client=stack.http, max_retries=0)


def answers_of(configs: list[ModelConfig], model: str) -> list[str]:
    """Each prompt's greedy answer, one request at a time, from a stack of these models."""
    async def scenario():
        async with local_stack(configs) as stack:
            return [await greedy(openai_client(stack), model, prompt) for prompt in PROMPTS]

    return asyncio.run(scenario())


def test_adapters_are_listed_and_mixed_requests_answer_as_each_adapter_fused_alone(adapters):
    fused = {name: answers_of([config(adapters, lora_paths=[str(path)])], MODEL)
             for name, path in (("a0", adapters.a0), ("a1", adapters.a1))}
    base = answers_of([config(adapters)], MODEL)
    assert fused["a0"] != base and fused["a1"] != base

    async def scenario():
        declared = config(adapters, adapters={"a0": str(adapters.a0), "a1": str(adapters.a1)})
        async with local_stack([declared]) as stack:
            client = openai_client(stack)
            listed = {m.id: m for m in (await client.models.list()).data}
            one = await client.models.retrieve(f"{MODEL}:a1")
            names = [MODEL, f"{MODEL}:a0", f"{MODEL}:a1"]
            mixed = await asyncio.gather(*(greedy(client, name, prompt) for name in names for prompt in PROMPTS))
            streamed = await greedy(client, f"{MODEL}:a0", PROMPTS[0], stream=True)
            with pytest.raises(openai.NotFoundError, match="has no adapter 'nope'"):
                await greedy(client, f"{MODEL}:nope", PROMPTS[0])
            return listed, one, mixed, streamed

    listed, one, mixed, streamed = asyncio.run(scenario())
    assert listed[f"{MODEL}:a0"].parent == MODEL and listed[f"{MODEL}:a1"].parent == MODEL
    assert getattr(listed[MODEL], "parent", None) is None and one.id == f"{MODEL}:a1" and one.parent == MODEL
    n = len(PROMPTS)
    assert mixed[:n] == base and mixed[n : 2 * n] == fused["a0"] and mixed[2 * n :] == fused["a1"]
    assert streamed == fused["a0"][0]


def test_admin_loads_and_unloads_adapters_under_the_model_roots(adapters, tmp_path):
    outside = write_mlx_lm_adapter(tmp_path / "outside", random_lora(load_model(adapters.model).model, 4, 5), scale=1.0)

    async def scenario():
        async with local_stack([config(adapters)], model_roots=[str(adapters.root)]) as stack:
            http, client = stack.http, openai_client(stack)
            refused = {
                "outside": await http.post("/v1/admin/load-adapter", json={
                    "model": MODEL, "adapter": "x", "path": str(outside)}),
                "dora": await http.post("/v1/admin/load-adapter", json={
                    "model": MODEL, "adapter": "x", "path": str(adapters.dora)}),
                "name": await http.post("/v1/admin/load-adapter", json={
                    "model": MODEL, "adapter": "a:b", "path": str(adapters.spare)}),
                "model": await http.post("/v1/admin/load-adapter", json={
                    "model": "nope", "adapter": "x", "path": str(adapters.spare)}),
            }
            loaded = await http.post("/v1/admin/load-adapter", json={
                "model": MODEL, "adapter": "spare", "path": str(adapters.spare)})
            ids = [m.id for m in (await client.models.list()).data]
            answer = await greedy(client, f"{MODEL}:spare", PROMPTS[0])
            unloaded = await http.post("/v1/admin/unload-adapter", json={"model": f"{MODEL}:spare"})
            with pytest.raises(openai.NotFoundError):
                await greedy(client, f"{MODEL}:spare", PROMPTS[0])
            again = await http.post("/v1/admin/unload-adapter", json={"model": MODEL, "adapter": "spare"})
            return refused, loaded, ids, answer, unloaded, again

    refused, loaded, ids, answer, unloaded, again = asyncio.run(scenario())
    assert refused["outside"].status_code == 400 and "outside the allowed model_roots" in refused["outside"].text
    assert refused["dora"].status_code == 400 and "use_dora" in refused["dora"].text
    assert refused["name"].status_code == 400 and "adapter name 'a:b'" in refused["name"].text
    assert refused["model"].status_code == 404
    assert loaded.status_code == 200, loaded.text
    assert loaded.json() == {"status": "loaded", "id": f"{MODEL}:spare", "model": MODEL, "adapter": "spare",
                             "path": str(adapters.spare)}
    assert f"{MODEL}:spare" in ids and f"{MODEL}:x" not in ids
    assert answer == answers_of([config(adapters, lora_paths=[str(adapters.spare)])], MODEL)[0]
    assert unloaded.status_code == 200 and unloaded.json()["status"] == "unloaded"
    assert again.status_code == 404
