"""The fused per-row LoRA kernel (engine/adapters/kernels.py) against MLX's own operations. It runs on a CUDA GPU
only; elsewhere the bank's dense form serves and these tests are skipped. On the lent GPU machine: bundles made with
`EXTRA="outlines-core==0.2.14 pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 packaging==26.4"`, then
`python -m pytest tests/engine/test_lora_kernel.py --confcutdir=tests/engine` (the suite's root conftest needs more)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from engine.adapters.kernels import MemberUpdate, dense_reference, fused_kernel_works, lora_rows
from tests.engine.test_lora import adapters, serving_core  # noqa: F401 (adapters: the fixture)

pytestmark = pytest.mark.skipif(not fused_kernel_works(), reason="the fused LoRA kernel serves on a CUDA GPU only")


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize("rank", [1, 16, 64])
def test_the_kernel_is_the_per_token_low_rank_update(dtype, rank):
    tokens, in_dims, slots = 37, 1000, 5  # shapes that fill neither a warp's stride nor a tile
    keys = iter(mx.random.split(mx.random.key(rank), 8))
    x = mx.random.normal((tokens, in_dims), key=next(keys)).astype(dtype)
    token_slots = mx.random.randint(0, slots, (tokens,), key=next(keys)).astype(mx.int32)
    members = [MemberUpdate(mx.random.normal((tokens, out), key=next(keys)).astype(dtype),
                            (0.05 * mx.random.normal((slots, rank, in_dims), key=next(keys))).astype(dtype),
                            (0.05 * mx.random.normal((slots, rank, out), key=next(keys))).astype(dtype))
               for out in (700, 256)]
    fused = lora_rows(x, token_slots, members)
    tolerance = 1e-4 if dtype == mx.float32 else 0.06
    for out, member in zip(fused, members):
        assert out.dtype == dtype and out.shape == member.y.shape
        expected = dense_reference(x, token_slots, member)
        assert mx.allclose(out.astype(mx.float32), expected, atol=tolerance, rtol=tolerance / 4).item()
        base_rows = token_slots == 0
        assert mx.array_equal(mx.where(base_rows[:, None], out, 0), mx.where(base_rows[:, None], member.y, 0))


def test_a_mixed_decode_forward_is_the_same_fused_or_dense(adapters):
    core = serving_core(adapters)
    bank = core.adapters.bank
    assert bank.fused
    tokens = mx.array([[5], [9], [13], [17], [21]])  # decode: one token a row, slots of every kind
    logits = {}
    for fused in (True, False):
        bank.fused = fused
        with bank.applying([1, 0, 4, 2, 3]):
            logits[fused] = core.loaded.model(tokens, cache=make_prompt_cache(core.loaded.model))
    # float32 matmuls on the GPU round their inputs to TF32 (10-bit mantissas); the kernel sums in float32
    assert mx.allclose(logits[True], logits[False], atol=1e-2, rtol=1e-2).item()
    assert mx.array_equal(logits[True].argmax(-1), logits[False].argmax(-1))
