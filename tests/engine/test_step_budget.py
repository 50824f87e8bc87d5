"""The per-step prefill budget is measured on this device at load (a GPU-sized constant stalled a CPU for minutes)."""

from __future__ import annotations

import mlx.core as mx

from engine import EngineConfig, EngineCore
from engine.device_memory import (
    CUDA_RUNTIME_SHARE, CardMemory, EngineMemoryLimit, MemoryReading, device_memory_bytes, engine_memory_limit_bytes,
    headroom_bytes, memory_reading, peak_memory_bytes, reset_peak_memory, shared_card_limit_bytes,
)
from engine.runner.step_budget import (
    MASKED_FORWARD_MARGIN, MAX_STEP_TOKENS, MIN_STEP_TOKENS, STEP_TARGET_S, measure_prefill_budget,
)
from engine.runner.prefill_shapes import largest_forward_tokens, largest_step_within


def test_an_unset_step_budget_is_what_this_device_prefills_in_the_target_time(tiny_llama):
    core = EngineCore(tiny_llama)
    budget, expected_s = core.config.prefill_step_tokens, core.expected_step_s
    assert MIN_STEP_TOKENS <= budget <= MAX_STEP_TOKENS
    if MIN_STEP_TOKENS < budget < MAX_STEP_TOKENS:  # unclamped: the budget fills the target step time
        assert abs(expected_s - STEP_TARGET_S) < 0.01
    assert core.stats().expected_step_s == expected_s
    assert core.config.prefill_token_budget == budget


def test_a_given_step_budget_is_kept_and_not_measured(tiny_llama):
    core = EngineCore(tiny_llama, EngineConfig(prefill_step_tokens=48))
    assert core.config.prefill_step_tokens == 48 and core.expected_step_s is None


def test_the_step_budget_is_cut_so_that_each_padded_forward_fits_the_memory_allowance(tiny_llama):
    free = measure_prefill_budget(tiny_llama.model, 4096, max_rows=32, chunk_tokens=512)
    per_token = free.transient_bytes_per_token
    assert per_token > 0  # the probe forward's activations and logits
    # Room for the padded forwards of a 1,500-token step: the bound must land at or above it, below the speed's.
    allowance = int(largest_forward_tokens(32, 1500, 512) * per_token * MASKED_FORWARD_MARGIN)
    bounded = measure_prefill_budget(tiny_llama.model, 4096, memory_allowance_bytes=allowance, max_rows=32, chunk_tokens=512)
    held = bounded.transient_bytes_per_token * MASKED_FORWARD_MARGIN
    assert bounded.step_tokens == largest_step_within(
        allowance / held, 32, 512, MIN_STEP_TOKENS, bounded.speed_step_tokens)
    # Each padded forward fits, unless the bound is the floor ("lowest when none does"): MLX's peak memory is the
    # process's, so a probe that also counted another thread's allocations (an earlier test's engine winding down;
    # an engine process has no other) can measure more per token than the allowance was made from.
    fits = largest_forward_tokens(32, bounded.step_tokens, 512) * held <= allowance
    assert fits or bounded.step_tokens == MIN_STEP_TOKENS
    # And it cuts below the speed's step wherever that step does not fit. (The allowance was made for 1,500 tokens
    # from the first probe; a second probe that measures fewer bytes a token, the first having counted an earlier
    # test's allocations, can find the speed's whole step within it: then it is not cut, rightly.)
    speed_fits = largest_forward_tokens(32, bounded.speed_step_tokens, 512) * held <= allowance
    assert bounded.step_tokens < bounded.speed_step_tokens or speed_fits


def test_a_kv_budget_that_takes_the_whole_device_leaves_prefill_the_smallest_step(tiny_llama):
    core = EngineCore(tiny_llama, EngineConfig(kv_budget_bytes=device_memory_bytes()))
    assert core.config.prefill_step_tokens == MIN_STEP_TOKENS


def test_the_prefill_allowance_is_what_mlxs_memory_limit_leaves_not_the_whole_device(tiny_llama):
    # Past its memory limit MLX waits for work in flight rather than allocate: a step sized by the whole device
    # would be sized past the point where its forwards stall (and, on CUDA, past what the card holds).
    kv = 64 * 2**20
    config = EngineConfig(kv_budget_bytes=kv, prefix_cache_bytes=0)
    roomy = EngineCore(tiny_llama, config)
    assert roomy.config.prefill_step_tokens > MIN_STEP_TOKENS
    roomy.close()
    previous = mx.set_memory_limit(mx.get_active_memory() + kv + 2**20)  # 1 MiB beside the weights and the KV
    try:
        tight = EngineCore(tiny_llama, config)
        assert tight.config.prefill_step_tokens == MIN_STEP_TOKENS
        assert mx.get_memory_limit() == engine_memory_limit_bytes()  # the engine's own, while it serves
        tight.close()
    finally:
        mx.set_memory_limit(previous)


def test_the_engines_peak_memory_reading_outlives_its_resets():
    # The engine resets MLX's peak to measure one forward (a probe, a tower run); the peak it reports stays the
    # process's.
    held = mx.zeros((1 << 20,), mx.float32)
    mx.eval(held)
    before = peak_memory_bytes()
    reset_peak_memory()
    assert peak_memory_bytes() >= before >= held.nbytes


def test_on_a_shared_card_mlx_may_hold_what_it_holds_plus_the_free_memory_less_the_runtime_share():
    gib = 2**30
    card = CardMemory(total_bytes=80 * gib, free_bytes=30 * gib)
    reserve = int(80 * gib * CUDA_RUNTIME_SHARE)
    # Another process took 40 GiB of the 50 GiB not held by our MLX (10 GiB): our limit falls to 10 + 30 - 8 GiB.
    assert shared_card_limit_bytes(card, mlx_held_bytes=10 * gib) == 40 * gib - reserve
    # Alone on the card (free + held = total): the card less the runtime share, as without the reading.
    assert shared_card_limit_bytes(CardMemory(80 * gib, 70 * gib), 10 * gib) == 80 * gib - reserve
    # A card others filled: nothing, never a negative limit.
    assert shared_card_limit_bytes(CardMemory(80 * gib, 0), gib) == 0


def test_the_engines_memory_limit_is_restored_at_close_and_bounds_the_towers_headroom():
    previous = mx.get_memory_limit()
    limit = EngineMemoryLimit()
    assert mx.get_memory_limit() == engine_memory_limit_bytes(previous)
    before = headroom_bytes()
    held = mx.zeros((1 << 20,), mx.float32)
    mx.eval(held)
    assert 0 < headroom_bytes() <= before - held.nbytes  # what MLX takes comes out of the towers' room
    limit.refresh()
    limit.restore()
    assert mx.get_memory_limit() == previous


def test_a_slow_steps_memory_reading_counts_what_mlx_holds_against_its_limit():
    before = memory_reading()
    held = mx.zeros((1 << 22,), mx.float32)  # 16 MiB
    mx.eval(held)
    now = memory_reading()
    assert now.active_bytes - before.active_bytes >= held.nbytes
    assert now.limit_bytes == mx.get_memory_limit() and now.cache_bytes == mx.get_cache_memory()
    gib = 2**30
    assert MemoryReading(3 * gib, gib // 2, 70 * gib).describe() == \
        "MLX holds 3.0 GiB active + 0.5 GiB cached of its 70.0 GiB limit"

