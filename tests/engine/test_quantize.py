"""quantize: 4 | 8 | auto. The plan's arithmetic against the safetensors headers, the conversion into the model
cache (once, reused, redone when the source changes), and a quantized model answering through the serving stack,
with auto picking 8 or 4 bits under a memory budget set here."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from deployments.config import ModelConfig
from engine.errors import ModelLoadError
from engine.models.quantize import (
    GIB,
    kv_cache_bytes,
    plan_quantization,
    quantized_folder,
    read_safetensors_headers,
    weights_bytes,
)
from tests.serve.local_stack import local_stack
from tests.support.tiny_models import LLAMA, write_model, write_wordlevel_tokenizer

VOCAB = 256
CONTEXT = 512


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    """A 2-layer llama in float32 (hidden 64, intermediate 128): every matrix quantizes in groups of 64."""
    root = tmp_path_factory.mktemp("quantize")
    tokenizer = write_wordlevel_tokenizer(root / "tokenizer", vocab_size=VOCAB)
    return write_model(root / "llama", dict(LLAMA, vocab_size=VOCAB), tokenizer, seed=0, scale=3.0)


def sizes(llama: Path) -> dict[int | None, int]:
    tensors = read_safetensors_headers(llama)
    return {bits: weights_bytes(tensors, bits) for bits in (None, 8, 4)}


def test_weights_and_kv_sizes_follow_the_headers(llama):
    config = json.loads((llama / "config.json").read_text())
    tensors = {t.name: t for t in read_safetensors_headers(llama)}
    embed = tensors["model.embed_tokens.weight"]
    assert embed.shape == (VOCAB, 64)
    per_element = {"F32": 4, "BF16": 2, "F16": 2}[embed.dtype]
    stored = sum(t.numel * {"F32": 4, "BF16": 2, "F16": 2}[t.dtype] for t in tensors.values())
    matrices = sum(t.numel for t in tensors.values() if len(t.shape) == 2)
    vectors = stored - matrices * per_element
    by_bits = sizes(llama)
    assert by_bits[None] == stored
    for bits in (8, 4):  # packed values, plus a scale and a bias per group of 64, plus the norms as stored
        assert by_bits[bits] == matrices * bits // 8 + (matrices // 64) * 2 * per_element + vectors
    # 2 layers x 2 KV heads x head_dim 16 x K and V x 2 bytes a value
    assert kv_cache_bytes(config, CONTEXT) == 2 * 2 * 2 * 16 * CONTEXT * 2


def test_auto_picks_the_widest_width_that_fits(llama):
    kv = kv_cache_bytes(json.loads((llama / "config.json").read_text()), CONTEXT)
    by_bits = sizes(llama)
    assert plan_quantization(llama, "auto", CONTEXT, by_bits[None] + kv).bits is None
    assert plan_quantization(llama, "auto", CONTEXT, by_bits[None] + kv - 1).bits == 8
    assert plan_quantization(llama, "auto", CONTEXT, by_bits[8] + kv - 1).bits == 4
    fixed = plan_quantization(llama, 8, CONTEXT, budget_bytes=1)  # a fixed width is not measured
    assert (fixed.bits, fixed.weights_bytes, fixed.budget_bytes) == (8, by_bits[8], None)
    with pytest.raises(ModelLoadError) as refused:
        plan_quantization(llama, "auto", CONTEXT, by_bits[4] + kv - 1)
    message = str(refused.value)
    assert "does not fit" in message and f"{(by_bits[4] + kv - 1) / GIB:.2f} GiB available" in message


def test_conversion_is_cached_and_redone_when_the_source_changes(llama, tmp_path):
    folder = quantized_folder(llama, 4, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    assert config["quantization"]["bits"] == 4 and config["quantization"]["group_size"] == 64
    assert folder.parent == tmp_path / "quantized" and folder.name.endswith("-q4")
    written = (folder / "model.safetensors").stat().st_mtime_ns
    assert quantized_folder(llama, 4, tmp_path) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == written  # reused, not converted again
    eight = quantized_folder(llama, 8, tmp_path)
    assert eight != folder and json.loads((eight / "config.json").read_text())["quantization"]["bits"] == 8
    assert [p.name for p in (tmp_path / "quantized").iterdir() if p.name.startswith(".") and "tmp" in p.name] == []
    # An already quantized model stays as it is under auto.
    assert plan_quantization(folder, "auto", CONTEXT, budget_bytes=10 * GIB).bits is None


@pytest.mark.parametrize(("spare_over", "bits"), [(8, 8), (4, 4)])
def test_a_model_loaded_with_auto_answers_at_the_width_that_fits(llama, tmp_path, monkeypatch, spare_over, bits):
    monkeypatch.setenv("ORCHARD_HOME", str(tmp_path))  # the quantized copy lands in this test's model cache
    kv = kv_cache_bytes(json.loads((llama / "config.json").read_text()), CONTEXT)
    budget = sizes(llama)[spare_over] + kv  # fits at `bits`, not at the next wider width
    config = ModelConfig(model_id="q", model_path=str(llama), context_length=CONTEXT, quantize="auto",
                         memory_budget_bytes=budget)

    async def scenario():
        async with local_stack([config]) as stack:
            answer = await stack.http.post("/v1/chat/completions", json={
                "model": "q", "messages": [{"role": "user", "content": "t1 t2"}], "max_tokens": 5,
                "temperature": 0, "ignore_eos": True})
            loaded = await stack.http.get("/v1/admin/loaded-models")
            return answer, loaded.json()

    answer, loaded = asyncio.run(scenario())
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 5
    path = Path(loaded["data"][0]["model_path"])
    assert path.parent == tmp_path / "models" / "quantized" and path.name.endswith(f"-q{bits}")
    assert json.loads((path / "config.json").read_text())["quantization"]["bits"] == bits


def test_quantize_is_refused_where_mlx_lm_cannot_convert():
    with pytest.raises(ValueError, match="'quantize' applies to model_type 'lm'"):
        ModelConfig(model_path="default-embedding", model_type="embedding", quantize=4)
