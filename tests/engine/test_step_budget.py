"""The per-step prefill budget is measured on this device at load (a GPU-sized constant stalled a CPU for minutes)."""

from __future__ import annotations

from engine import EngineConfig, EngineCore
from engine.runner.step_budget import MAX_STEP_TOKENS, MIN_STEP_TOKENS, STEP_TARGET_S


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
