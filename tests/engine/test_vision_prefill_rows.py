"""Prompts with images prefilled several in one forward (engine/vision/embedded_split.py): Qwen2.5-VL's language
model splits into backbone + head fed each prompt's M-RoPE positions; a step's completing prompts then run as one
right-padded forward whose first-token logits and KV equal each prompt's through the model's own call. Gemma 3's
prompts carry no positions and keep the model's call."""

from __future__ import annotations

import mlx.core as mx

from engine import EngineConfig, EngineCore
from engine.kv.batch_cache import new_request_cache
from engine.runner.vision_prefill import run_vision_prefill
from engine.scheduler_output import PrefillChunk
from engine.vision.embedded_split import EmbeddedSplit, embedded_split
from tests.engine.test_batching import assert_same_stream
from tests.engine.test_vision_engine import Family, alone
from tests.support.drive import Arrival, run_core
from tests.support.tiny_vlms import write_gemma3, write_qwen25_vl
from tests.support.vlm_images import png_bytes

SIZES = [(112, 84), (84, 112), (112, 112), (56, 112)]


def _prompts(family: Family, sizes):
    requests = [family.request(f"r{i}", [png_bytes(*size, seed=i)], text=f"t{20 + i} t11 t12") for i, size in enumerate(sizes)]
    model = family.loaded.model
    return requests, {r.request_id: model.embed_prompt(r.prompt_token_ids, r.vision) for r in requests}


def _next_logits(model, result, row: int, embedded) -> mx.array:
    """The logits of the token after the prompt, on the KV the prefill wrote."""
    token = mx.array([[int(mx.argmax(result.last_logits[row]).item())]])
    return model(token, cache=result.caches[row], rope_deltas=mx.array([[embedded.rope_delta]]))


def test_a_steps_prompts_with_images_run_as_one_forward_equal_to_each_through_the_models_call(tmp_path):
    family = Family(write_qwen25_vl(tmp_path / "qwen"))
    model = family.loaded.model
    requests, embedded = _prompts(family, SIZES)
    split = embedded_split(model, embedded["r0"], lambda: new_request_cache(model))
    assert split is not None
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return split.backbone(*args, **kwargs)

    chunks = [PrefillChunk(r.request_id, 0, tuple(r.prompt_token_ids), True) for r in requests]
    together = run_vision_prefill(model, chunks, [new_request_cache(model) for _ in chunks], embedded,
                                  split=EmbeddedSplit(counted, split.head))
    assert calls == [(len(chunks), max(len(r.prompt_token_ids) for r in requests))]  # one right-padded forward
    assert [c.request_id for c in together.completing] == [r.request_id for r in requests]
    for row, chunk in enumerate(chunks):
        own = run_vision_prefill(model, [chunk], [new_request_cache(model)], embedded)  # the model's call
        assert mx.array_equal(together.last_logits[row], own.last_logits[0]).item(), chunk.request_id
        assert together.caches[row][0].offset == len(chunk.token_ids)
        mine, theirs = (_next_logits(model, r, i, embedded[chunk.request_id]) for r, i in ((together, row), (own, 0)))
        assert mx.array_equal(mine, theirs).item(), chunk.request_id


def test_in_the_engine_they_stream_as_each_alone_beside_text(tmp_path):
    family = Family(write_qwen25_vl(tmp_path / "qwen"))

    def requests():
        with_images = [family.request(f"r{i}", [png_bytes(*size, seed=i)], max_tokens=6) for i, size in enumerate(SIZES)]
        return with_images + [family.request("text", [], text="t30 t31 t32", max_tokens=6)]

    expected = {r.request_id: alone(family, r) for r in requests()}
    core = EngineCore(family.loaded, EngineConfig(enable_prefix_cache=False, max_prefill_seqs=8))
    together = run_core(core, [Arrival(0, r) for r in requests()])
    for request_id, stream in expected.items():
        assert_same_stream(stream, together[request_id])


def test_a_model_whose_prompts_carry_no_positions_keeps_its_own_call(tmp_path):
    family = Family(write_gemma3(tmp_path / "gemma"))
    model = family.loaded.model
    _, embedded = _prompts(family, SIZES[:1])
    assert not EmbeddedSplit.takes(embedded["r0"])
    assert embedded_split(model, embedded["r0"], lambda: new_request_cache(model)) is None


def test_the_check_runs_on_a_prompts_first_tokens_and_fails_on_a_head_that_differs(tmp_path, monkeypatch):
    """The probe forward covers the prompt's first PROBE_TOKENS only (the model's call computes logits at every
    position); a split whose head is not the model's is refused."""
    import engine.vision.embedded_split as embedded_split_module

    family = Family(write_qwen25_vl(tmp_path / "qwen"))
    model = family.loaded.model
    _, embedded = _prompts(family, SIZES[:1])
    assert embedded["r0"].token_ids.shape[1] > 40
    monkeypatch.setattr(embedded_split_module, "PROBE_TOKENS", 40)
    split = embedded_split(model, embedded["r0"], lambda: new_request_cache(model))
    assert split is not None
    scaled = EmbeddedSplit(split.backbone, lambda hidden: 2 * split.head(hidden))
    assert not embedded_split_module.agrees(model, scaled, embedded["r0"], lambda: new_request_cache(model))
