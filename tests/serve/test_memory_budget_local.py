"""The node's memory budget through the admin API (in process): a load that would pass it unloads the least
recently used idle model that is not pinned; a model with a request running is kept; a load that cannot fit is
refused with 507 naming the budget, its footprint and what is held; an idle model unloads after idle_unload_s."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from deployments.config import ModelConfig
from deployments.ingress.footprint import model_footprint
from deployments.model_calls import GenerateJob, TextPrompt
from engine.sampling.params import SamplingParams
from tests.serve.local_stack import local_stack, wait_for
from tests.serve.test_metrics_local import Scrape


def footprint(folder: Path) -> int:
    return model_footprint(ModelConfig(model_path=str(folder))).total_bytes


async def load(stack, model_id: str, folder: Path, **fields) -> tuple[int, dict]:
    answer = await stack.http.post("/v1/admin/load-model", json={"model_id": model_id, "model_path": str(folder), **fields})
    return answer.status_code, answer.json()


async def resident(stack) -> list[str]:
    return sorted(m["id"] for m in (await stack.http.get("/v1/models")).json()["data"])


def chat(model: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "t1 t2"}], "max_tokens": 2}


def test_loads_evict_the_least_recently_used_idle_unpinned_model_or_are_refused(tiny_models, tmp_path):
    folders = {"alpha": tiny_models.alpha, "beta": tiny_models.beta, "gamma": tiny_models.gamma}
    budget = 2 * max(footprint(f) for f in folders.values()) + 1024

    async def scenario():
        async with local_stack([], tmp_path, model_roots=[str(tiny_models.alpha.parent)],
                               memory_budget_bytes=budget) as stack:
            assert (await load(stack, "alpha", folders["alpha"], pinned=True))[0] == 200
            assert (await load(stack, "beta", folders["beta"]))[0] == 200
            assert (await stack.http.post("/v1/chat/completions", json=chat("beta"))).status_code == 200
            assert (await load(stack, "gamma", folders["gamma"]))[0] == 200  # beta goes: alpha is pinned
            assert await resident(stack) == ["alpha", "gamma"]

            client = await stack.registry.route("gamma")
            held = client.generate(GenerateJob("held", TextPrompt(text="t1"),
                                               SamplingParams(max_tokens=60000, ignore_eos=True), stream=True))
            await anext(held)  # gamma is serving a request: nothing can make room for beta
            try:
                status, body = await load(stack, "beta", folders["beta"])
            finally:
                await held.aclose()
            assert status == 507 and body["error"]["code"] == "insufficient_memory", body
            for words in ("'beta' needs about", "the memory budget is", "alpha", "(pinned)", "gamma",
                          "(1 requests running)"):
                assert words in body["error"]["message"], body
            assert (await load(stack, "beta", folders["beta"]))[0] == 200  # the request ended: gamma goes
            assert await resident(stack) == ["alpha", "beta"]
            counted = stack.registry.memory.residency.counted_bytes()
            assert counted <= budget and counted == footprint(folders["alpha"]) + footprint(folders["beta"])

            scrape = Scrape((await stack.http.get("/metrics")).text)
            def sample(name: str, model: str) -> float | None:
                return scrape.values.get((f"orchard:{name}", (("model_name", model),)))
            assert [sample("model_loads_total", m) for m in ("alpha", "beta", "gamma")] == [1, 2, 1]
            assert [sample("model_evictions_total", m) for m in ("alpha", "beta", "gamma")] == [0, 1, 1]
            assert [sample("model_resident_bytes", m) for m in ("alpha", "beta", "gamma")] == [
                footprint(folders["alpha"]), footprint(folders["beta"]), 0]
            listing = (await stack.http.get("/v1/admin/loaded-models")).json()["memory_budget"]
            assert listing["budget_bytes"] == budget and listing["counted_bytes"] == counted
            assert [(e["event"], e["model_id"]) for e in listing["events"]] == [
                ("load", "alpha"), ("load", "beta"), ("load", "gamma"), ("evict", "beta"), ("refused", "beta"),
                ("load", "beta"), ("evict", "gamma")]
            assert [(m["id"], m["pinned"]) for m in listing["models"]] == [("alpha", True), ("beta", False)]

    asyncio.run(scenario())


def test_an_idle_model_unloads_after_its_idle_time_and_a_pinned_one_stays(tiny_models, tmp_path):
    async def scenario():
        async with local_stack([], tmp_path, model_roots=[str(tiny_models.alpha.parent)],
                               memory_budget_bytes=10 * footprint(tiny_models.alpha)) as stack:
            assert (await load(stack, "quiet", tiny_models.alpha, idle_unload_s=0.5))[0] == 200
            assert (await load(stack, "kept", tiny_models.beta, idle_unload_s=0.5, pinned=True))[0] == 200

            async def quiet_gone():
                return await resident(stack) == ["kept"]
            await wait_for(quiet_gone, timeout_s=20)
            assert stack.registry.memory.counters.idle_unloads == {"quiet": 1}

    asyncio.run(scenario())


def test_a_footprint_counts_the_weights_as_loaded_and_the_kv_and_cache_it_is_then_given(tiny_models):
    from deployments.ingress.footprint import RESIDENT_PREFIX_CACHE_BYTES, sized_config
    from engine.models.quantize import kv_cache_bytes, read_safetensors_headers, weights_bytes

    folder = tiny_models.alpha
    config = ModelConfig(model_path=str(folder))
    counted = model_footprint(config)
    stored = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    assert counted.weights_bytes == weights_bytes(read_safetensors_headers(folder), None) <= stored
    model_config = json.loads((folder / "config.json").read_text())
    context = min(model_config["max_position_embeddings"], 32768)
    assert (counted.kv_bytes, counted.cache_bytes) == (kv_cache_bytes(model_config, context), RESIDENT_PREFIX_CACHE_BYTES)
    sized = sized_config(config, counted)
    assert (sized.kv_budget_bytes, sized.prefix_cache_bytes) == (counted.kv_bytes, counted.cache_bytes)
    own = ModelConfig(model_path=str(folder), kv_budget_bytes=1 << 20, enable_prefix_cache=False, quantize=4)
    counted_own = model_footprint(own)
    assert (counted_own.kv_bytes, counted_own.cache_bytes) == (1 << 20, 0)
    assert counted_own.weights_bytes < counted.weights_bytes  # counted at 4 bits
    assert sized_config(own, counted_own) == own


def test_on_demand_models_rotate_under_a_budget_for_two(tiny_models, tmp_path):
    """Three on_demand models, room for two: requests rotating over them all succeed (loads and evictions on the
    way), streamed ones too; the counted bytes never pass the budget (sampled every 100 ms)."""
    folders = {"alpha": tiny_models.alpha, "beta": tiny_models.beta, "gamma": tiny_models.gamma}
    budget = 2 * max(footprint(f) for f in folders.values()) + 1024
    on_demand = [ModelConfig(model_id=name, model_path=str(folder)) for name, folder in folders.items()]

    async def scenario():
        async with local_stack([], tmp_path, memory_budget_bytes=budget, on_demand=on_demand) as stack:
            listed = (await stack.http.get("/v1/models")).json()["data"]
            assert [(m["id"], m["status"]) for m in listed] == [(n, "unloaded") for n in ("alpha", "beta", "gamma")]
            samples: list[int] = []

            async def sample() -> None:
                while True:
                    samples.append(stack.registry.memory.residency.resident_bytes())
                    await asyncio.sleep(0.1)
            sampler = asyncio.create_task(sample())
            try:
                for turn, name in enumerate(["alpha", "beta", "gamma", "alpha", "beta", "gamma", "beta"]):
                    body = {**chat(name), "stream": turn % 2 == 1}
                    answer = await stack.http.post("/v1/chat/completions", json=body)
                    assert answer.status_code == 200, answer.text
                    if body["stream"]:
                        assert answer.text.rstrip().endswith("data: [DONE]") and '"error"' not in answer.text
                    else:
                        assert answer.json()["choices"][0]["finish_reason"] == "length"
            finally:
                sampler.cancel()
            assert samples and max(samples) <= budget
            events = [(e["event"], e["model_id"]) for e in
                      (await stack.http.get("/v1/admin/loaded-models")).json()["memory_budget"]["events"]]
            assert events.count(("evict", "alpha")) == 2 and ("evict", "beta") in events
            listed = {m["id"]: m["status"] for m in (await stack.http.get("/v1/models")).json()["data"]}
            assert listed == {"alpha": "unloaded", "beta": "running", "gamma": "running"}

    asyncio.run(scenario())


def test_concurrent_requests_over_three_on_demand_models_all_succeed_within_the_budget(tiny_models, tmp_path):
    """Nine requests at once over three models with room for two: loads wait for room the others' requests free."""
    folders = {"alpha": tiny_models.alpha, "beta": tiny_models.beta, "gamma": tiny_models.gamma}
    budget = 2 * max(footprint(f) for f in folders.values()) + 1024
    on_demand = [ModelConfig(model_id=name, model_path=str(folder)) for name, folder in folders.items()]

    async def scenario():
        async with local_stack([], tmp_path, memory_budget_bytes=budget, on_demand=on_demand) as stack:
            samples: list[int] = []

            async def sample() -> None:
                while True:
                    samples.append(stack.registry.memory.residency.resident_bytes())
                    await asyncio.sleep(0.1)

            async def ask(name: str, stream: bool):
                return await stack.http.post("/v1/chat/completions", json={**chat(name), "stream": stream})
            sampler = asyncio.create_task(sample())
            try:
                answers = await asyncio.gather(*(ask(name, i % 2 == 0) for i, name in
                                                 enumerate(["alpha", "beta", "gamma"] * 3)))
            finally:
                sampler.cancel()
            for answer in answers:
                assert answer.status_code == 200 and '"error"' not in answer.text, answer.text
            assert samples and max(samples) <= budget

    asyncio.run(scenario())


def test_after_a_restart_the_loaded_models_come_back_and_the_evicted_one_does_not(tiny_models, tmp_path):
    folders = {"alpha": tiny_models.alpha, "beta": tiny_models.beta, "gamma": tiny_models.gamma}
    budget = 2 * max(footprint(f) for f in folders.values()) + 1024
    roots = [str(tiny_models.alpha.parent)]

    async def first_run():
        async with local_stack([], tmp_path, model_roots=roots, memory_budget_bytes=budget) as stack:
            assert (await load(stack, "alpha", folders["alpha"], pinned=True))[0] == 200
            assert (await load(stack, "beta", folders["beta"]))[0] == 200
            assert (await load(stack, "gamma", folders["gamma"]))[0] == 200  # beta evicted

    async def second_run():
        async with local_stack([], tmp_path, model_roots=roots, memory_budget_bytes=budget) as stack:
            async def restored():
                listed = (await stack.http.get("/v1/models")).json()["data"]
                return sorted((m["id"], m["status"]) for m in listed) == [("alpha", "running"), ("gamma", "running")]
            await wait_for(restored, timeout_s=30)
            held = [(m.model_id, m.pinned) for m in stack.registry.memory.residency.models()]
            assert held == [("alpha", True), ("gamma", False)]

    asyncio.run(first_run())
    asyncio.run(second_run())


def test_serve_config_models_are_counted_at_what_they_measure_and_never_evicted(tiny_models, tmp_path):
    configured = ModelConfig(model_id="configured", model_path=str(tiny_models.alpha))
    budget = footprint(tiny_models.beta) + 1024  # room for beta alone: the configured model measures more than 1 KiB

    async def scenario():
        async with local_stack([configured], tmp_path, model_roots=[str(tiny_models.alpha.parent)],
                               memory_budget_bytes=budget) as stack:
            await stack.http.post("/v1/chat/completions", json=chat("configured"))  # its weights and KV in MLX now
            status, body = await load(stack, "beta", tiny_models.beta)
            held = {m.model_id: m for m in stack.registry.memory.residency.models()}
            assert held["configured"].pinned and held["configured"].footprint_bytes > 1024
            assert status == 507 and "configured" in body["error"]["message"], body
            assert "(pinned)" in body["error"]["message"] and await resident(stack) == ["configured"]

    asyncio.run(scenario())
