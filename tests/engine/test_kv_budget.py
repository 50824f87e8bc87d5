"""The KV budget on a real model (MLX on the CPU): 32 requests whose KV is 4x the budget all finish, token for token
as without a budget, while the KV the runner really holds never passes it; preempted requests resume by recompute."""

from __future__ import annotations

import random

import pytest

from engine import EngineConfig, EngineCore, Request, SamplingParams
from engine.errors import KVBudgetExceededError
from engine.kv.kv_layout import kv_bytes_per_token
from engine.spec_decode.config import SpeculativeConfig
from tests.support.drive import Collected, collect

NUM_REQUESTS = 32
MAX_TOKENS = 48
ALLOCATION_STEP = 256


def prompts() -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(250) for _ in range(24)]  # a shared system prompt: prefix-cache hits
    lengths = [rng.randrange(4, 40) for _ in range(NUM_REQUESTS - 4)] + [90, 120, 70, 100]  # and a few long ones
    return [shared + [rng.randrange(250) for _ in range(n)] for n in lengths]


def sampling(index: int) -> SamplingParams:
    """Greedy and seeded sampling; some with a frequency penalty (the counts of generated tokens must survive a
    preemption: the resumed prefill's prompt holds them, but they are not prompt tokens)."""
    penalty = 0.8 if index % 4 >= 2 else 0.0
    if index % 2 == 0:
        return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, frequency_penalty=penalty, ignore_eos=True)
    return SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.9, seed=500 + index, frequency_penalty=penalty,
        ignore_eos=True,
    )


def config(**fields) -> EngineConfig:
    base = {"max_decode_seqs": 32, "prefill_chunk_tokens": 16, "prefill_step_tokens": 64, "prefix_block_size": 8}
    return EngineConfig(**{**base, **fields})


def run(core: EngineCore, budget: int | None) -> tuple[dict[str, Collected], int]:
    """All requests at once; the KV the runner holds is read after every step. Returns outputs and its peak."""
    for i, prompt in enumerate(prompts()):
        core.add_request(core.limits.validate(Request(f"r{i}", prompt, sampling(i))))
    results: dict[str, Collected] = {}
    admitted: list[str] = []
    peak = 0
    while core.has_unfinished_requests():
        outputs = core.step(on_admitted=lambda outputs: admitted.extend(o.request_id for o in outputs))
        for output in outputs:
            assert output.error is None, output.error
        collect(outputs, results)
        peak = max(peak, core.runner.kv_cache_bytes())
        if budget is not None:
            assert core.scheduler.kv_planned_bytes <= budget
    # A preempted request's stream only pauses: it is announced once, and never errs (above).
    assert sorted(admitted) == sorted(results)
    return results, peak


@pytest.fixture(scope="module")
def unconstrained(tiny_llama) -> dict[str, Collected]:
    return run(EngineCore(tiny_llama, config()), None)[0]


def quarter_of_total_kv(model) -> int:
    """A budget of a quarter of what the requests' KV takes in all, each alone (as the budget counts it)."""
    per_token = kv_bytes_per_token(model)
    total = sum((len(p) + MAX_TOKENS + ALLOCATION_STEP) * per_token for p in prompts())
    return total // 4


def test_thirty_two_requests_over_four_times_the_budget_finish_as_without_it(tiny_llama, unconstrained):
    budget = quarter_of_total_kv(tiny_llama.model)
    core = EngineCore(tiny_llama, config(kv_budget_bytes=budget))
    results, peak = run(core, budget)
    assert sorted(results) == sorted(unconstrained)
    for request_id, expected in unconstrained.items():
        assert results[request_id].token_ids == expected.token_ids, request_id
        assert len(expected.token_ids) == MAX_TOKENS and results[request_id].finish.reason.value == "length"
    stats = core.stats()
    assert 0 < peak <= budget and core.scheduler.kv_peak_planned_bytes <= budget
    assert stats.kv_budget_bytes == budget and stats.kv_bytes_per_token == kv_bytes_per_token(tiny_llama.model)
    assert stats.num_preemptions > 0 and stats.num_preempted == 0
    assert stats.prefix_cache.hits > 0  # resumptions (and the shared system prompt) read cached KV


def test_speculative_rows_stay_within_the_budget(tiny_llama, unconstrained):
    """Accepted drafts grow a row by several tokens a step: the plan counts every draft the step may write."""
    budget = quarter_of_total_kv(tiny_llama.model)
    spec = SpeculativeConfig(method="ngram", num_draft_tokens=4, min_match=1, max_match=3, adaptive=False)
    core = EngineCore(tiny_llama, config(kv_budget_bytes=budget, speculative=spec))
    results, peak = run(core, budget)
    for i in range(NUM_REQUESTS):  # greedy rows say what plain decoding says; sampled ones draw otherwise
        tokens = results[f"r{i}"].token_ids
        assert tokens == unconstrained[f"r{i}"].token_ids if i % 2 == 0 else len(tokens) == MAX_TOKENS, i
    assert 0 < peak <= budget and core.stats().num_preemptions > 0
    assert core.stats().speculation.drafted_tokens > 0


def test_a_request_that_cannot_fit_alone_is_refused_naming_the_numbers(tiny_llama):
    per_token = kv_bytes_per_token(tiny_llama.model)
    core = EngineCore(tiny_llama, config(kv_budget_bytes=(ALLOCATION_STEP + 100) * per_token))
    fits = Request("fits", list(range(60)), SamplingParams(max_tokens=40))
    assert core.limits.validate(fits).sampling.max_tokens == 40
    with pytest.raises(KVBudgetExceededError) as refused:
        core.limits.validate(Request("big", list(range(60)), SamplingParams(max_tokens=41)))
    assert refused.value.param == "max_tokens" and refused.value.code == "kv_budget_exceeded"
    assert f"101 tokens (60 in the prompt + 41 to generate) at {per_token} bytes per token" in refused.value.message
    assert f"KV budget is {(ALLOCATION_STEP + 100) * per_token} bytes (at most 100 tokens" in refused.value.message
    # Without max_tokens a request gets what the budget leaves it, like the room the context leaves.
    unbounded = core.limits.validate(Request("any", list(range(60)), SamplingParams()))
    assert unbounded.sampling.max_tokens == 40
