"""One GPU kernel for the per-row LoRA update of a layer, or of sibling layers that read the same input.

out_m = y_m + (x A_m[slot]) B_m[slot] for every token and member m, each token on its own row's slot (slot 0: no
adapter, out = y). A block takes one (member, token): its rank-R x A into shared memory, then every output column:
the base output's one read and write plus R (in + out) multiply-adds a token. Why a kernel of our own: on the lent
H200 a decode step is bound by per-operation overhead (~13 µs an operation whatever it computes), and the dense
form (x A_all, a row mask, addmm: bank.py) takes three operations a layer, five for q/k/v, where this takes one.
CUDA only (mx.fast.cuda_kernel); elsewhere, or if it does not build or agree with the dense form on first use, the
bank keeps the dense form.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx

logger = logging.getLogger(__name__)

THREADS = 256  # a block's: 8 warps share x A's rank-R sums, then stride over the output columns

HEADER = r"""
template <typename T, int RANK>
__device__ void lora_rows_member(const T* x, const int* token_slots, const T* y, const T* a, const T* b, T* out,
                                 int in_dims, int out_dims) {
  __shared__ float h[RANK];
  const int token = blockIdx.y;
  const int slot = token_slots[token];
  const T* y_row = y + (size_t)token * out_dims;
  T* out_row = out + (size_t)token * out_dims;
  if (slot == 0) {  // the base row: its output as it is (uniform over the block: no barrier skipped by some)
    for (int j = threadIdx.x; j < out_dims; j += blockDim.x) out_row[j] = y_row[j];
    return;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  const T* x_row = x + (size_t)token * in_dims;
  for (int r = warp; r < RANK; r += warps) {
    const T* a_row = a + ((size_t)slot * RANK + r) * in_dims;
    float sum = 0.f;
    for (int i = lane; i < in_dims; i += 32) sum += (float)x_row[i] * (float)a_row[i];
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_down_sync(0xffffffff, sum, offset);
    if (lane == 0) h[r] = sum;
  }
  __syncthreads();
  const T* b_slot = b + (size_t)slot * RANK * out_dims;
  for (int j = threadIdx.x; j < out_dims; j += blockDim.x) {
    float sum = (float)y_row[j];
    for (int r = 0; r < RANK; ++r) sum += h[r] * (float)b_slot[(size_t)r * out_dims + j];
    out_row[j] = (T)sum;
  }
}
"""


@dataclass(frozen=True)
class MemberUpdate:
    """One layer's share of a fused update: its base output y [tokens, out], its adapters' A [slots, R, in] and
    scale·B [slots, R, out], all in one dtype."""

    y: mx.array
    a: mx.array
    b: mx.array


def _source(members: int) -> str:
    """The kernel body: block (m, token) updates member m's output at that token."""
    cases = [f"  case {m}: lora_rows_member<T, RANK>(x, token_slots, y{m}, a{m}, b{m}, out{m}, IN_DIMS, OUT{m}); break;"
             for m in range(members)]
    return "\n".join(["switch (blockIdx.x) {", *cases, "}"])


@functools.cache
def _kernel(members: int):
    inputs = ["x", "token_slots"] + [f"{name}{m}" for m in range(members) for name in ("y", "a", "b")]
    return mx.fast.cuda_kernel(name=f"orchard_lora_rows_{members}", input_names=inputs,
                               output_names=[f"out{m}" for m in range(members)], source=_source(members),
                               header=HEADER)


def lora_rows(x: mx.array, token_slots: mx.array, members: Sequence[MemberUpdate]) -> list[mx.array]:
    """Each member's y plus its per-token update; x [tokens, in], token_slots [tokens] int32."""
    tokens, in_dims = x.shape
    template: list[tuple[str, object]] = [("T", x.dtype), ("RANK", members[0].a.shape[1]), ("IN_DIMS", in_dims)]
    inputs = [x, token_slots]
    for m, member in enumerate(members):
        template.append((f"OUT{m}", member.y.shape[-1]))
        inputs += [member.y, member.a, member.b]
    return _kernel(len(members))(
        inputs=inputs, template=template, grid=(len(members) * THREADS, tokens, 1), threadgroup=(THREADS, 1, 1),
        output_shapes=[member.y.shape for member in members], output_dtypes=[x.dtype] * len(members))


def dense_reference(x: mx.array, token_slots: mx.array, member: MemberUpdate) -> mx.array:
    """The same update with MLX's own operations, in float32 (the first-use check's answer); slot 0 adds nothing."""
    a, b = member.a.astype(mx.float32)[token_slots], member.b.astype(mx.float32)[token_slots]
    h = (x.astype(mx.float32)[:, None, :] @ a.swapaxes(1, 2))  # [tokens, 1, R]
    return member.y.astype(mx.float32) + (h @ b)[:, 0, :] * (token_slots != 0)[:, None]


@functools.cache
def fused_kernel_works() -> bool:
    """On a CUDA GPU (the default device), whether the kernel builds and agrees with MLX's own operations."""
    if not (mx.cuda.is_available() and mx.default_device() == mx.gpu):
        return False
    try:
        key = mx.random.key(0)
        x = mx.random.normal((5, 72), key=key).astype(mx.bfloat16)
        slots = mx.array([0, 2, 1, 2, 0], mx.int32)
        members = [MemberUpdate(mx.random.normal((5, out), key=mx.random.key(out)).astype(mx.bfloat16),
                                mx.random.normal((3, 8, 72), key=mx.random.key(out + 1)).astype(mx.bfloat16) * 0.1,
                                mx.random.normal((3, 8, out), key=mx.random.key(out + 2)).astype(mx.bfloat16) * 0.1)
                   for out in (300, 40)]
        fused = lora_rows(x, slots, members)
        agree = all(mx.allclose(out.astype(mx.float32), dense_reference(x, slots, member), atol=0.05, rtol=0.02).item()
                    for out, member in zip(fused, members))
    except Exception:  # noqa: BLE001 — a JIT that cannot build it (no NVRTC headers...): the dense form serves
        logger.warning("the fused LoRA kernel does not build here; per-row adapters use dense matmuls", exc_info=True)
        return False
    if not agree:
        logger.warning("the fused LoRA kernel disagrees with dense matmuls here; per-row adapters use dense matmuls")
    return agree


__all__ = ["MemberUpdate", "fused_kernel_works", "lora_rows"]
