"""LoRA adapters in the engine: per-request adapters share decode steps, each row exactly as if served alone."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.tuner.utils import load_adapters

from engine import EngineConfig, EngineCore, Request, SamplingParams
from engine.spec_decode.config import SpeculativeConfig
from engine.adapters.fuse import LoadTimeAdapter, apply_load_time_adapters
from engine.adapters.registry import AdapterSlotsBusyError
from engine.errors import InvalidRequestError, ModelExistsError, ModelNotFoundError
from engine.models.loader import LoadedModel, load_model
from tests.engine.test_batching import assert_same_stream
from tests.support.drive import Arrival, run_core
from tests.support.tiny_adapters import random_lora, write_mlx_lm_adapter, write_peft_adapter

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=True)


@dataclass(frozen=True)
class Adapters:
    model: Path
    paths: list[Path]  # mlx-lm r4 (attention), PEFT r8 (q + down), PEFT rsLoRA r16 (attention), mlx-lm r2 (MLP)


@pytest.fixture(scope="module")
def adapters(tiny_llama: LoadedModel, tmp_path_factory) -> Adapters:
    root, model = tmp_path_factory.mktemp("adapters"), tiny_llama.model
    return Adapters(tiny_llama.path, [
        write_mlx_lm_adapter(root / "mlx-r4", random_lora(model, 4, 11), scale=2.0),
        write_peft_adapter(root / "peft-r8", random_lora(model, 8, 12, targets=("self_attn.q_proj", "mlp.down_proj")),
                           alpha=16),
        write_peft_adapter(root / "peft-r16", random_lora(model, 16, 13), alpha=8, rslora=True),
        write_mlx_lm_adapter(root / "mlx-r2", random_lora(model, 2, 14, targets=("mlp.gate_proj", "mlp.up_proj")),
                             scale=4.0),
    ])


def serving_core(adapters: Adapters, **config) -> EngineCore:
    """An engine of its own model copy (loading adapters wraps the model's layers) with the four adapters loaded."""
    core = EngineCore(load_model(adapters.model), EngineConfig(**config))
    for index, path in enumerate(adapters.paths):
        core.load_adapter(f"a{index}", path)
    return core


def fused_core(adapters: Adapters, index: int | None) -> EngineCore:
    """The adapter fused into the model at load (Bodega's lora_paths), or the base model (None)."""
    loaded = load_model(adapters.model)
    if index is not None:
        apply_load_time_adapters(loaded.model, [LoadTimeAdapter(adapters.paths[index])])
    return EngineCore(loaded, EngineConfig())


def random_prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(250) for _ in range(rng.randrange(3, 45))] for _ in range(count)]


# Plain steps; padded prefill forwards (the GPU default: chunks share padded batches); n-gram drafts verified in
# batched forwards (repetitive prompts, so that drafts are made).
ENGINES = {
    "plain": {},
    "padded-prefill": dict(pad_prefill_shapes=True, prefill_warmup_seconds=0, max_prefill_seqs=4),
    "speculative": dict(speculative=SpeculativeConfig(method="ngram", num_draft_tokens=3, min_match=1, max_match=2,
                                                      adaptive=False)),
}


@pytest.mark.parametrize("engine", ENGINES)
def test_a_batch_mixing_four_adapters_and_base_rows_matches_each_served_alone(adapters, engine):
    names = [None, "a0", "a1", "a2", "a3"] * 2
    prompts = random_prompts(len(names), seed=5)
    if engine == "speculative":
        prompts = [(p[:4] * 10)[:30] for p in prompts]
    core = serving_core(adapters, max_decode_seqs=16, prefill_chunk_tokens=16, **ENGINES[engine])
    arrivals = [Arrival(i // 3, Request(f"r{i}", prompts[i], GREEDY, adapter=name)) for i, name in enumerate(names)]
    batched = run_core(core, arrivals)
    for i, name in enumerate(names):
        index = None if name is None else int(name[1:])
        fused = run_core(fused_core(adapters, index), [Arrival(0, Request("alone", prompts[i], GREEDY))])["alone"]
        assert_same_stream(fused, batched[f"r{i}"])
    assert core.stats().num_steps < 10 * 12 / 2  # the rows really shared their steps
    if engine == "speculative":
        assert core.stats().speculation.accepted_tokens > 0


def test_an_adapter_row_alone_and_in_a_mixed_batch_agree_and_differ_from_the_base(adapters):
    prompt = random_prompts(1, seed=9)[0]
    alone = run_core(serving_core(adapters), [Arrival(0, Request("x", prompt, GREEDY, adapter="a2"))])["x"]
    others = [Request(f"o{i}", p, GREEDY, adapter=name)
              for i, (p, name) in enumerate(zip(random_prompts(4, seed=10), ["a0", None, "a3", "a1"]))]
    mixed = run_core(serving_core(adapters), [Arrival(0, r) for r in others] + [Arrival(1, Request("x", prompt, GREEDY, adapter="a2"))])
    assert_same_stream(alone, mixed["x"])
    base = run_core(fused_core(adapters, None), [Arrival(0, Request("x", prompt, GREEDY))])["x"]
    assert base.token_ids != alone.token_ids


def test_the_per_row_update_is_mlx_lms_lora_linear(adapters):
    """Forward logits of a mixed batch against mlx-lm's own LoRALinear model for each row's adapter: equal up to
    float32 summation order (ranks are zero-padded to the bank's widest); the base row exactly."""
    tokens = mx.array([[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]])
    core = serving_core(adapters)
    with core.adapters.bank.applying([1, 0, 4]):
        mixed = core.loaded.model(tokens, cache=make_prompt_cache(core.loaded.model))
    reference = {}
    for slot, path in ((1, adapters.paths[0]), (4, adapters.paths[3])):
        model = load_model(adapters.model).model
        load_adapters(model, str(path))
        reference[slot] = model(tokens, cache=make_prompt_cache(model))
    base = load_model(adapters.model).model
    assert mx.allclose(mixed[0], reference[1][0], atol=1e-4, rtol=0)
    assert mx.array_equal(mixed[1], base(tokens, cache=make_prompt_cache(base))[1])
    assert mx.allclose(mixed[2], reference[4][2], atol=1e-4, rtol=0)
    assert not mx.allclose(mixed[0], base(tokens, cache=make_prompt_cache(base))[0], atol=1e-2)


def test_prefix_cache_blocks_are_keyed_by_adapter_and_by_load(adapters):
    prompt = (random_prompts(1, seed=3)[0] * 40)[:100]  # three whole 32-token blocks before its last token
    core = serving_core(adapters, prefix_block_size=32)

    def hit_tokens(request_id: str, adapter: str | None) -> tuple[int, list[int]]:
        before = core.stats().prefix_cache.hit_tokens
        out = run_core(core, [Arrival(0, Request(request_id, prompt, GREEDY, adapter=adapter))])[request_id]
        return core.stats().prefix_cache.hit_tokens - before, out.token_ids

    assert hit_tokens("base1", None)[0] == 0
    first_a0 = hit_tokens("a0-1", "a0")
    assert first_a0[0] == 0  # the base model's blocks are not a0's
    second_a0 = hit_tokens("a0-2", "a0")
    assert second_a0[0] == 96 and second_a0[1] == first_a0[1]  # a0's own blocks: cached == uncached
    assert hit_tokens("a1-1", "a1")[0] == 0
    core.unload_adapter("a0")
    core.load_adapter("a0", adapters.paths[3])  # the same name, other weights: a new load
    reloaded = hit_tokens("a0-3", "a0")
    assert reloaded[0] == 0 and reloaded[1] != first_a0[1]
    assert hit_tokens("base2", None)[0] == 96


def test_slots_are_least_recently_used_and_never_taken_from_a_running_request(adapters):
    core = EngineCore(load_model(adapters.model), EngineConfig(max_loras=2))
    core.load_adapter("x", adapters.paths[0])
    core.load_adapter("y", adapters.paths[1])
    core.add_request(Request("uses-x", [1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True), adapter="x"))
    core.load_adapter("z", adapters.paths[2])  # x is in use: y (idle) goes
    assert sorted(a.name for a in core.adapters.slots.listing()) == ["x", "z"]
    with pytest.raises(ModelNotFoundError, match="No adapter 'y'"):
        core.add_request(Request("uses-y", [1, 2], GREEDY, adapter="y"))
    core.add_request(Request("uses-z", [1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True), adapter="z"))
    with pytest.raises(AdapterSlotsBusyError, match="All 2 adapter slots"):
        core.load_adapter("w", adapters.paths[3])
    with pytest.raises(ModelExistsError):
        core.load_adapter("x", adapters.paths[3])
    core.unload_adapter("x")  # uses-x runs on: its slot stays taken until it ends
    with pytest.raises(AdapterSlotsBusyError):
        core.load_adapter("w", adapters.paths[3])
    core.abort_request("uses-x")
    assert core.load_adapter("w", adapters.paths[3]).slot == 1


def test_adapters_that_cannot_be_served_are_refused_naming_why(adapters, tmp_path, wordlevel_tokenizer_dir):
    from tests.support.tiny_models import LLAMA, write_model

    core = EngineCore(load_model(adapters.model), EngineConfig(max_lora_rank=8))
    wider = load_model(write_model(tmp_path / "wider", dict(LLAMA, vocab_size=256, hidden_size=96),
                                   wordlevel_tokenizer_dir)).model
    cases = {
        "rank 16, over this model's max_lora_rank 8": adapters.paths[2],
        "k_proj' is 64 -> 32 in the model but the adapter's A (96, 4)": write_mlx_lm_adapter(tmp_path / "other", random_lora(wider, 4, 1), scale=1.0),
        "use_dora": write_peft_adapter(tmp_path / "dora", random_lora(core.loaded.model, 4, 1), alpha=8, use_dora=True),
        "modules_to_save": write_peft_adapter(tmp_path / "save", random_lora(core.loaded.model, 4, 1), alpha=8,
                                              modules_to_save=["lm_head"]),
        "no adapter folder": tmp_path / "missing",
        "has no adapter_config.json": tmp_path,
    }
    (tmp_path / "no-weights").mkdir()
    (tmp_path / "no-weights" / "adapter_config.json").write_text("{}")
    cases["holds neither adapters.safetensors (mlx-lm) nor adapter_model.safetensors (PEFT)"] = tmp_path / "no-weights"
    dora = tmp_path / "mlx-dora"
    write_mlx_lm_adapter(dora, random_lora(core.loaded.model, 4, 1), scale=1.0)
    (dora / "adapter_config.json").write_text('{"fine_tune_type": "dora", "lora_parameters": {"scale": 1.0}}')
    cases["fine_tune_type 'dora'"] = dora
    for words, path in cases.items():
        with pytest.raises(InvalidRequestError) as refused:
            core.load_adapter("bad", path)
        assert words in refused.value.message and refused.value.param == "adapter_path", refused.value.message
    assert core.adapters.slots.listing() == [] and not core.adapters.active


def test_load_time_adapters_stack_with_their_scales_and_stay_unfused_on_a_quantized_model(adapters):
    """lora_paths + lora_scales: on float weights the update is fused (W += ...); on quantized weights mlx-lm's
    LoRALinear carries it (both adapters' ranks side by side), matching mlx-lm's own adapter for a lone one."""
    tokens = mx.array([[3, 4, 5, 6, 7]])

    def logits(model: nn.Module) -> mx.array:
        return model(tokens, cache=make_prompt_cache(model))

    half = load_model(adapters.model).model
    apply_load_time_adapters(half, [LoadTimeAdapter(adapters.paths[0], 0.5)])
    twice_half = load_model(adapters.model).model
    apply_load_time_adapters(twice_half, [LoadTimeAdapter(adapters.paths[0], 0.25), LoadTimeAdapter(adapters.paths[0], 0.25)])
    assert mx.allclose(logits(half), logits(twice_half), atol=1e-4)

    quantized = load_model(adapters.model).model
    nn.quantize(quantized, group_size=32, bits=8)
    reference = load_model(adapters.model).model
    nn.quantize(reference, group_size=32, bits=8)
    load_adapters(reference, str(adapters.paths[0]))
    apply_load_time_adapters(quantized, [LoadTimeAdapter(adapters.paths[0])])
    assert type(dict(quantized.named_modules())["model.layers.0.self_attn.q_proj"]).__name__ == "LoRALinear"
    assert mx.allclose(logits(quantized), logits(reference), atol=1e-4)
