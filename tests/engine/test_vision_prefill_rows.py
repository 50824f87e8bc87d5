"""Prompts with images prefilled several in one forward (engine/vision/embedded_split.py): Qwen2.5-VL's language
model splits into backbone + head fed each prompt's M-RoPE positions; a step's completing prompts then run as one
right-padded forward whose first-token logits and KV equal each prompt's through the model's own call. Gemma 3's
prompts carry no positions and keep the model's call."""

from __future__ import annotations

import mlx.core as mx
import pytest

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


def _next_logits(model, result, row: int, embedded, chunk_index: int | None = None) -> mx.array:
    """The logits of the token after the prompt (its first-token logits: `row` of the completing ones), on the KV the
    prefill wrote (`chunk_index`'s cache; default `row`)."""
    token = mx.array([[int(mx.argmax(result.last_logits[row]).item())]])
    cache = result.caches[row if chunk_index is None else chunk_index]
    return model(token, cache=cache, rope_deltas=mx.array([[embedded.rope_delta]]))


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


def test_padded_they_run_in_the_text_paths_bucketed_forwards_equal_to_each_through_the_models_call(tmp_path):
    """With padded shapes (the GPU's default) the step's prompts with images run as the text path pads them: 78-86
    tokens as the 128 bucket, 9 rows as the 11-row bucket (two filler rows), a plain cache, no array mask; a chunk
    that does not complete its prompt runs in the same forward."""
    family = Family(write_qwen25_vl(tmp_path / "qwen"))
    model = family.loaded.model
    requests, embedded = _prompts(family, [SIZES[i % len(SIZES)] for i in range(9)])
    split = embedded_split(model, embedded["r0"], lambda: new_request_cache(model))
    calls = []

    def counted(tokens, **kwargs):
        calls.append((tokens.shape, kwargs["inputs_embeds"].shape[:2], kwargs["position_ids"].shape))
        return split.backbone(tokens, **kwargs)

    assert {len(r.prompt_token_ids) for r in requests} == {78, 82, 86}
    unfinished = 2  # its first 40 tokens
    chunks = [PrefillChunk(r.request_id, 0, tuple(r.prompt_token_ids[:40] if i == unfinished else r.prompt_token_ids),
                           i != unfinished) for i, r in enumerate(requests)]
    together = run_vision_prefill(model, chunks, [new_request_cache(model) for _ in chunks], embedded,
                                  split=EmbeddedSplit(counted, split.head), rows_limit=12,
                                  vocab_size=model.language_model.args.vocab_size)
    assert calls == [((11, 128), (11, 128), (3, 11, 128))]
    assert [c.request_id for c in together.completing] == [c.request_id for c in chunks if c.completes_prefill]
    assert [shared.rows for shared in together.shared] == [list(range(9))]
    row = 0
    for i, chunk in enumerate(chunks):
        assert together.caches[i][0].offset == len(chunk.token_ids)
        if not chunk.completes_prefill:
            continue
        own = run_vision_prefill(model, [chunk], [new_request_cache(model)], embedded)  # the model's call
        assert mx.allclose(together.last_logits[row], own.last_logits[0], atol=1e-4).item(), chunk.request_id
        mine = _next_logits(model, together, row, embedded[chunk.request_id], i)
        theirs = _next_logits(model, own, 0, embedded[chunk.request_id])
        assert mx.allclose(mine, theirs, atol=1e-4).item(), chunk.request_id
        row += 1


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
def test_in_the_engine_they_stream_as_each_alone_beside_text(tmp_path, padded):
    """`padded`: the GPU's default shapes, with prompts cut into chunks (their later chunks at a cache offset, beside
    filler rows of zero KV)."""
    family = Family(write_qwen25_vl(tmp_path / "qwen"))

    def requests():
        with_images = [family.request(f"r{i}", [png_bytes(*size, seed=i)], max_tokens=6) for i, size in enumerate(SIZES)]
        return with_images + [family.request("text", [], text="t30 t31 t32", max_tokens=6)]

    expected = {r.request_id: alone(family, r) for r in requests()}
    shapes = dict(pad_prefill_shapes=True, prefill_warmup_seconds=0, prefill_chunk_tokens=48) if padded else {}
    core = EngineCore(family.loaded, EngineConfig(enable_prefix_cache=False, max_prefill_seqs=8, **shapes))
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
