"""The per-step prefill budget is measured on this device at load (a GPU-sized constant stalled a CPU for minutes)."""

from __future__ import annotations

from engine import EngineConfig, EngineCore
from engine.device_memory import device_memory_bytes
from engine.runner.step_budget import (
    MASKED_FORWARD_MARGIN, MAX_PADDED_TOKENS_FACTOR, MAX_STEP_TOKENS, MIN_STEP_TOKENS, STEP_TARGET_S,
    measure_prefill_budget,
)


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


def test_the_step_budget_is_cut_to_what_a_padded_forward_may_hold(tiny_llama):
    free = measure_prefill_budget(tiny_llama.model, 4096)
    assert free.transient_bytes_per_token > 0  # the probe forward's activations and logits
    allowance = 5_000_000
    bounded = measure_prefill_budget(tiny_llama.model, 4096, memory_allowance_bytes=allowance)
    per_token = bounded.transient_bytes_per_token
    assert bounded.step_tokens == max(MIN_STEP_TOKENS, int(allowance / (per_token * MAX_PADDED_TOKENS_FACTOR * MASKED_FORWARD_MARGIN)))
    assert bounded.step_tokens < free.step_tokens


def test_a_kv_budget_that_takes_the_whole_device_leaves_prefill_the_smallest_step(tiny_llama):
    core = EngineCore(tiny_llama, EngineConfig(kv_budget_bytes=device_memory_bytes()))
    assert core.config.prefill_step_tokens == MIN_STEP_TOKENS
