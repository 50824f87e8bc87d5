"""Convert a llama-family GGUF into a dense Hugging Face-style folder that `mlx_lm.load` reads.

The folder holds `config.json`, `model.safetensors` (dequantized, in one float dtype: CPU MLX runs
quantized matmuls far slower than dense ones), `tokenizer.json`, `tokenizer_config.json` and a
completion marker. It is written in a temporary sibling and renamed into place, so a crash never
leaves a folder that looks complete.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import mlx.core as mx
import numpy as np
from tokenizers import Tokenizer

from engine.models.gguf_tokenizer import build_tokenizer, tokenizer_config

CONVERTER_VERSION = 1
MARKER_NAME = ".orchard-complete"
DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}

# ggml type ids (ggml.h). mx.load returns Q4_0/Q4_1/Q8_0 as affine triplets with group size 32,
# F32/F16 as is, and dequantizes Q6_K to float16 itself (checked against ggml's dequantizer).
GGML_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 8: "Q8_0", 14: "Q6_K", 30: "BF16"}
# mx.load (MLX 0.32.4) reads these, but wrongly: half of each Q4_K block differs from ggml's values.
_MISREAD_BY_MLX = {12: "Q4_K"}
_AFFINE_BITS = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}
_GGML_GROUP_SIZE = 32

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (rows first), i.e. GGUF's ne reversed
    type_name: str
    offset: int  # absolute byte offset of the data in the file


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, dtype: str = "bfloat16",
                 *, overwrite: bool = False) -> Path:
    """Convert `gguf_path` into the folder `out_dir` (created here) and return its path."""
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    gguf_path, out_dir = Path(gguf_path), Path(out_dir).absolute()
    if (out_dir.exists() or out_dir.is_symlink()) and not overwrite:
        raise FileExistsError(f"{out_dir} already exists")
    infos = read_tensor_infos(gguf_path)
    raw, meta = mx.load(str(gguf_path), return_metadata=True)
    meta = _plain_metadata(meta)
    config = build_config(meta, infos, dtype)
    tokenizer = build_tokenizer(meta)  # before the weights, so an unsupported tokenizer fails fast
    weights = convert_weights(gguf_path, raw, infos, config, DTYPES[dtype])
    del raw
    tok_config = tokenizer_config(meta, config["max_position_embeddings"])
    marker = {"converter_version": CONVERTER_VERSION, "gguf_sha256": file_sha256(gguf_path),
              "dtype": dtype, "source": gguf_path.name}
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        _write_folder(tmp, config, weights, tokenizer, tok_config, marker)
        _install(tmp, out_dir, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def read_marker(folder: Path) -> dict[str, Any] | None:
    """The completion marker of a converted folder, or None if absent or unreadable."""
    try:
        return json.loads((folder / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return None


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# --- GGUF header: mx.load hides the tensor types (BF16 and K-quants both come back as float16).

_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


def read_tensor_infos(path: Path) -> dict[str, TensorInfo]:
    """Tensor names, shapes, types and data offsets from a GGUF (v2/v3) header."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"unsupported GGUF version {version}")
        pos, alignment = 24, 32
        for _ in range(n_kv):
            key, pos = _read_string(buf, pos)
            (value_type,) = struct.unpack_from("<I", buf, pos)
            if key == "general.alignment":
                (alignment,) = struct.unpack_from("<I", buf, pos + 4)
            pos = _skip_value(buf, pos + 4, value_type)
        raw_infos = []
        for _ in range(n_tensors):
            name, pos = _read_string(buf, pos)
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            ggml_type, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            raw_infos.append((name, tuple(reversed(dims)), ggml_type, offset))
    data_start = -(-pos // alignment) * alignment
    return {name: TensorInfo(name, shape, _type_name(name, t), data_start + off)
            for name, shape, t, off in raw_infos}


def _read_string(buf: mmap.mmap, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", buf, pos)
    return buf[pos + 8 : pos + 8 + length].decode("utf-8", errors="replace"), pos + 8 + length


def _skip_value(buf: mmap.mmap, pos: int, value_type: int) -> int:
    if value_type in _SCALAR_SIZES:
        return pos + _SCALAR_SIZES[value_type]
    if value_type == _STRING:
        return _read_string(buf, pos)[1]
    if value_type != _ARRAY:
        raise ValueError(f"corrupt GGUF: unknown metadata value type {value_type}")
    item_type, count = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    if item_type in _SCALAR_SIZES:
        return pos + count * _SCALAR_SIZES[item_type]
    for _ in range(count):
        pos = _skip_value(buf, pos, item_type)
    return pos


def _type_name(tensor: str, ggml_type: int) -> str:
    if ggml_type in _MISREAD_BY_MLX:
        raise ValueError(f"tensor {tensor!r} is {_MISREAD_BY_MLX[ggml_type]}, which mx.load dequantizes "
                         f"incorrectly; unsupported GGML type {ggml_type}")
    if ggml_type not in GGML_TYPES:
        raise ValueError(f"tensor {tensor!r} has unsupported GGML type {ggml_type}; "
                         f"supported: {', '.join(GGML_TYPES.values())}")
    return GGML_TYPES[ggml_type]


def _plain_metadata(meta: dict[str, Any]) -> dict[str, Any]:
    # mx.load returns numbers as 0-d (or 1-d) mx.arrays; plain Python values are easier to use.
    return {k: (v.tolist() if isinstance(v, mx.array) else v) for k, v in meta.items()}


# --- config.json


def build_config(meta: dict[str, Any], infos: dict[str, TensorInfo], dtype: str) -> dict[str, Any]:
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r}; only 'llama' can be converted")
    if "rope_freqs.weight" in infos:
        raise ValueError("GGUF has rope_freqs (Llama 3.1-style rope scaling), which is not supported")

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"llama.{key}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks llama.{key}")
        if isinstance(value, list):
            raise ValueError(f"per-layer llama.{key} is not supported")
        return value

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    if {int(get("attention.value_length", head_dim)), int(get("rope.dimension_count", head_dim))} != {head_dim}:
        raise ValueError("GGUF with value length or rotary dims different from head_dim is not supported")
    vocab = int(meta.get("llama.vocab_size") or infos["token_embd.weight"].shape[0])
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "max_position_embeddings": int(get("context_length", 2048)),
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _f32(get("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(meta),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in infos,
        "attention_bias": "blk.0.attn_q.bias" in infos,
        "mlp_bias": False,
        "hidden_act": "silu",
        "torch_dtype": dtype,
        **_token_ids(meta),
    }
    return config


def _f32(value: float) -> float:
    # GGUF stores float32: 9.999999747e-06 reads back as the 1e-05 it was written from.
    return float(str(np.float32(value)))


def _rope_scaling(meta: dict[str, Any]) -> dict[str, Any] | None:
    kind = meta.get("llama.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {"type": "linear", "factor": _f32(meta["llama.rope.scaling.factor"])}
    raise ValueError(f"unsupported rope scaling {kind!r}")


def _token_ids(meta: dict[str, Any]) -> dict[str, Any]:
    ids: dict[str, Any] = {}
    for name, key in (("bos_token_id", "bos_token_id"), ("pad_token_id", "padding_token_id")):
        if f"tokenizer.ggml.{key}" in meta:
            ids[name] = int(meta[f"tokenizer.ggml.{key}"])
    # End-of-turn tokens also stop generation (Llama 3 writes eot separately from eos).
    eos = [int(meta[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta]
    eos = list(dict.fromkeys(eos))
    if eos:
        ids["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    return ids


# --- weights


def convert_weights(gguf_path: Path, raw: dict[str, mx.array], infos: dict[str, TensorInfo],
                    config: dict[str, Any], dtype: mx.Dtype) -> dict[str, mx.array]:
    """Dequantized weights under mlx-lm llama names, with Q/K rows back in Hugging Face order."""
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    weights = {}
    for name, info in infos.items():
        hf_name = hf_tensor_name(name)
        tensor = _dense_tensor(gguf_path, raw, info)
        kind = name.split(".")[2] if name.startswith("blk.") else ""
        if kind in heads:
            tensor = unpermute_rows(tensor, heads[kind])
        weights[hf_name] = tensor.astype(dtype)
        mx.eval(weights[hf_name])  # bound peak memory to one float32 tensor at a time
    return weights


def hf_tensor_name(name: str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{int(parts[1])}.{_LAYER_NAMES[parts[2]]}"
    raise ValueError(f"unsupported tensor {name!r} for a llama GGUF")


def _dense_tensor(gguf_path: Path, raw: dict[str, mx.array], info: TensorInfo) -> mx.array:
    """One tensor as float32, in numpy row order."""
    if info.type_name == "BF16":
        # mx.load narrows BF16 to float16 (overflow above 65504), so read those bytes ourselves.
        count = int(np.prod(info.shape))
        bits = np.fromfile(gguf_path, dtype=np.uint16, count=count, offset=info.offset)
        tensor = mx.array(bits).view(mx.bfloat16).reshape(info.shape).astype(mx.float32)
    elif info.type_name in _AFFINE_BITS:
        tensor = _dequantize_affine(raw, info)
    else:
        tensor = raw[info.name].astype(mx.float32)
    if tuple(tensor.shape) != info.shape:
        raise ValueError(f"tensor {info.name!r}: got shape {tensor.shape}, header says {info.shape}")
    return tensor


def _dequantize_affine(raw: dict[str, mx.array], info: TensorInfo) -> mx.array:
    base = info.name.removesuffix(".weight")
    packed, scales, biases = raw[info.name], raw[f"{base}.scales"], raw[f"{base}.biases"]
    bits = packed.shape[-1] * 32 // (scales.shape[-1] * _GGML_GROUP_SIZE)
    if packed.dtype != mx.uint32 or bits != _AFFINE_BITS[info.type_name]:
        raise ValueError(f"tensor {info.name!r}: unexpected {info.type_name} layout from mx.load")
    # Scales and biases in float32 so q * scale + bias is not rounded to float16 on the way.
    return mx.dequantize(packed, scales.astype(mx.float32), biases.astype(mx.float32),
                         group_size=_GGML_GROUP_SIZE, bits=bits)


def unpermute_rows(weight: mx.array, n_heads: int) -> mx.array:
    """Undo llama.cpp's Q/K permutation (convert_hf_to_gguf.py `permute`).

    llama.cpp regroups each head's rows from "first half / second half" (HF rotate_half) into
    interleaved pairs (GPT-J style rope); this puts them back.
    """
    rows = weight.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"cannot unpermute {rows} rows over {n_heads} heads")
    rest = tuple(weight.shape[1:])
    grouped = weight.reshape(n_heads, rows // n_heads // 2, 2, *rest)
    return grouped.swapaxes(1, 2).reshape(weight.shape)


# --- writing


def _write_folder(folder: Path, config: dict[str, Any], weights: dict[str, mx.array], tokenizer: Tokenizer,
                  tok_config: dict[str, Any], marker: dict[str, Any]) -> None:
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    _fsync_path(folder / "model.safetensors")
    _write_json(folder / "config.json", config)
    tokenizer.save(str(folder / "tokenizer.json"))
    _fsync_path(folder / "tokenizer.json")
    _write_json(folder / "tokenizer_config.json", tok_config)
    _write_json(folder / MARKER_NAME, marker)  # last: its presence means every other file is whole
    _fsync_path(folder)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, ensure_ascii=False)
        f.write("\n")
        _fsync_file(f)


def _fsync_file(f: IO[Any]) -> None:
    f.flush()
    os.fsync(f.fileno())


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _install(tmp: Path, out_dir: Path, overwrite: bool) -> None:
    """Rename the finished temp folder to `out_dir`; an old folder is moved aside first."""
    old = None
    if overwrite and (out_dir.exists() or out_dir.is_symlink()):
        old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
        os.rename(out_dir, old / "previous")
    os.rename(tmp, out_dir)  # fails if out_dir reappeared meanwhile with content
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    _fsync_path(out_dir.parent)
