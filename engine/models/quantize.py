"""Quantization at load: `quantize: 4 | 8 | auto` converts a model folder with mlx-lm's converter into Orchard's
model cache once, and reuses it afterwards.

`auto` sizes the model before loading it: the weights (read from the safetensors headers, no tensor loaded) plus
the KV cache of one full-context request must fit in the memory MLX can use. The model is kept as it is if it fits,
else quantized to the widest of 8 and 4 bits that fits; if none does the load is refused with the numbers.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import struct
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from engine.errors import ModelLoadError
from engine.models.default_model import exclusive_lock

logger = logging.getLogger(__name__)

QuantizeRequest = Literal[4, 8, "auto"]
GROUP_SIZE = 64
AUTO_BITS = (8, 4)  # widest first
MARKER_FILE = ".orchard-quantized.json"
MARKER_VERSION = 1
GIB = 1024**3
# Bytes per element of the safetensors dtypes a checkpoint holds.
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "U32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass(frozen=True)
class QuantizePlan:
    """What a load will run: `bits` None keeps the weights as stored."""

    bits: int | None
    weights_bytes: int  # at the chosen width
    kv_bytes: int  # one request's KV cache at the full context
    budget_bytes: int | None  # what MLX may use (None: not asked, a fixed width was requested)

    def describe(self) -> str:
        width = f"{self.bits}-bit" if self.bits else "as stored"
        budget = f" of {self.budget_bytes / GIB:.2f} GiB available" if self.budget_bytes is not None else ""
        return (f"{width}: weights {self.weights_bytes / GIB:.2f} GiB + KV {self.kv_bytes / GIB:.2f} GiB"
                f"{budget}")


@dataclass(frozen=True)
class _Tensor:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count


def plan_quantization(
    folder: Path, requested: QuantizeRequest, context_length: int, budget_bytes: int | None = None
) -> QuantizePlan:
    """The width a load of `folder` runs at; `auto` measures against budget_bytes (None: memory_budget_bytes())."""
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    tensors = read_safetensors_headers(folder)
    kv = kv_cache_bytes(config, context_length)
    if requested != "auto":
        return QuantizePlan(int(requested), weights_bytes(tensors, int(requested)), kv, None)
    budget = budget_bytes if budget_bytes is not None else memory_budget_bytes()
    candidates = [None] if config.get("quantization") else [None, *AUTO_BITS]  # a quantized model stays as it is
    sizes = {bits: weights_bytes(tensors, bits) for bits in candidates}
    for bits in candidates:
        if sizes[bits] + kv <= budget:
            return QuantizePlan(bits, sizes[bits], kv, budget)
    smallest = candidates[-1]
    raise ModelLoadError(
        f"the model does not fit: {QuantizePlan(smallest, sizes[smallest], kv, budget).describe()} "
        f"(as stored: {sizes[None] / GIB:.2f} GiB); lower context_length or free memory"
    )


def read_safetensors_headers(folder: Path) -> list[_Tensor]:
    """Every tensor's name, dtype and shape from the folder's *.safetensors headers (no data read)."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {folder}: quantize needs safetensors weights")
    tensors = []
    for path in files:
        with path.open("rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        tensors += [_Tensor(name, spec["dtype"], tuple(spec["shape"]))
                    for name, spec in header.items() if name != "__metadata__"]
    return tensors


def weights_bytes(tensors: list[_Tensor], bits: int | None) -> int:
    """The weights' size at `bits` (None: as stored). mlx-lm quantizes the matrices of Linear and Embedding
    layers whose rows divide into groups; each group adds a scale and a bias in the weights' float dtype."""
    total = 0
    for tensor in tensors:
        stored = tensor.numel * _DTYPE_BYTES.get(tensor.dtype, 2)
        if bits is None or not _quantizable(tensor):
            total += stored
            continue
        groups = tensor.numel // GROUP_SIZE
        total += tensor.numel * bits // 8 + groups * 2 * _DTYPE_BYTES.get(tensor.dtype, 2)
    return total


def _quantizable(tensor: _Tensor) -> bool:
    return (len(tensor.shape) == 2 and tensor.name.endswith(".weight") and tensor.shape[-1] % GROUP_SIZE == 0
            and tensor.dtype in ("F32", "F16", "BF16"))


def kv_cache_bytes(config: dict, context_length: int, bytes_per_value: int = 2) -> int:
    """Keys and values of every layer for `context_length` tokens (16-bit), from the model's config."""
    text = config.get("text_config") or config
    layers = int(text.get("num_hidden_layers", 0))
    heads = int(text.get("num_attention_heads", 1))
    kv_heads = int(text.get("num_key_value_heads") or heads)
    head_dim = int(text.get("head_dim") or int(text.get("hidden_size", 0)) // max(heads, 1))
    return 2 * layers * kv_heads * head_dim * context_length * bytes_per_value


def memory_budget_bytes() -> int:
    """What MLX may use now: the device's working set (Metal, CUDA) capped by the memory the system has free
    (unified memory, and the CPU backend, share it with every other process)."""
    import mlx.core as mx

    from engine.device_memory import accelerator_memory_bytes

    limits = []
    device = accelerator_memory_bytes()
    if device:
        limits.append(device - int(mx.get_active_memory()))
    available = _system_available_bytes()
    if available is not None:
        limits.append(available)
    if not limits:
        raise ModelLoadError("cannot tell how much memory is available: set quantize to 4 or 8")
    return min(limits)


def _system_available_bytes() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:  # macOS and other POSIX systems
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def quantized_folder(source: Path, bits: int, cache_root: Path, trust_remote_code: bool = False) -> Path:
    """`source` quantized to `bits` under cache_root/quantized (converted once; reused while the source's files
    are unchanged). Two processes converting at once serialize on a file lock; a crash leaves no folder."""
    identity = _source_identity(source, bits)
    root = cache_root / "quantized"
    folder = root / f"{source.name}-{identity['digest'][:12]}-q{bits}"
    if _marker_matches(folder, identity):
        return folder
    root.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(root / f".{folder.name}.lock"):
        if not _marker_matches(folder, identity):
            _convert(source, folder, bits, identity, trust_remote_code)
    return folder


def _convert(source: Path, folder: Path, bits: int, identity: dict, trust_remote_code: bool) -> None:
    from mlx_lm import convert

    temp = folder.parent / f".{folder.name}.tmp-{uuid.uuid4().hex}"
    logger.info("quantizing %s to %d bits into %s", source, bits, folder)
    try:
        convert(str(source), str(temp), quantize=True, q_bits=bits, q_group_size=GROUP_SIZE,
                trust_remote_code=trust_remote_code)
        (temp / MARKER_FILE).write_text(json.dumps(identity), encoding="utf-8")
        if folder.exists():  # a stale conversion of an older version of the source
            shutil.rmtree(folder)
        os.replace(temp, folder)
    except Exception as exc:
        raise ModelLoadError(f"quantizing {source} to {bits} bits failed: {exc}") from exc
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def _source_identity(source: Path, bits: int) -> dict:
    """The source's files by name, size and mtime, and the conversion's settings: a changed source converts again."""
    files = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in source.iterdir() if p.is_file())
    identity = {"version": MARKER_VERSION, "source": str(source), "bits": bits, "group_size": GROUP_SIZE,
                "files": files}
    identity["digest"] = hashlib.sha256(json.dumps(identity).encode()).hexdigest()
    return json.loads(json.dumps(identity))  # tuples as lists, as read back from the marker


def _marker_matches(folder: Path, identity: dict) -> bool:
    try:
        return json.loads((folder / MARKER_FILE).read_text(encoding="utf-8")) == identity
    except (OSError, ValueError):
        return False
