"""Prefix cache in the engine: cached == uncached, no cross-talk, budget held, off where it cannot be exact."""

from __future__ import annotations

import random

import pytest

from engine import EngineConfig, EngineCore, Request, SamplingParams
from tests.engine.test_batching import assert_same_stream
from tests.support.drive import Arrival, Collected, run_core

BLOCK = 8


def greedy(max_tokens: int = 10) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=True)


def words(count: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(250) for _ in range(count)]


def uncached(loaded, prompt, sampling):
    core = EngineCore(loaded, EngineConfig(enable_prefix_cache=False))
    return run_core(core, [Arrival(0, Request("u", prompt, sampling))])["u"]


def cached_core(loaded, **config) -> EngineCore:
    return EngineCore(loaded, EngineConfig(prefix_block_size=BLOCK, **config))


def test_a_cache_hit_gives_the_same_logprobs_as_no_cache(tiny_llama):
    shared = words(70, seed=1)
    core = cached_core(tiny_llama)
    run_core(core, [Arrival(0, Request("first", shared + [3, 4, 5], greedy()))])
    second_prompt = shared + [9, 8, 7, 6]
    hit = run_core(core, [Arrival(0, Request("second", second_prompt, greedy()))])["second"]
    assert hit.finish.usage.cached_tokens == 64  # 8 full blocks of the 70 shared tokens
    assert_same_stream(uncached(tiny_llama, second_prompt, greedy()), hit)
    stats = core.stats().prefix_cache
    assert stats.hits >= 1 and stats.hit_tokens >= 64


def test_multi_turn_chat_reuses_the_generated_tokens_too(tiny_llama):
    core = cached_core(tiny_llama)
    turn1_prompt = words(40, seed=2)
    turn1 = run_core(core, [Arrival(0, Request("t1", turn1_prompt, greedy(24)))])["t1"]
    turn2_prompt = turn1_prompt + turn1.token_ids + [11, 12, 13]
    turn2 = run_core(core, [Arrival(0, Request("t2", turn2_prompt, greedy()))])["t2"]
    assert turn2.finish.usage.cached_tokens > len(turn1_prompt)
    assert_same_stream(uncached(tiny_llama, turn2_prompt, greedy()), turn2)


def test_a_row_leaving_a_padded_batch_caches_its_own_generated_tokens(tiny_llama):
    # Turn 1 decodes beside a longer and a shorter neighbour (so its batch row is left-padded)
    # and leaves first; its prompt + generated KV, cut from the batch, must serve turn 2 exactly.
    turn2_prompt, turn2 = second_turn_after_leaving_a_padded_batch(cached_core(tiny_llama))
    # The KV held 30 + 17 - 1 tokens (the last sampled one is never fed): 5 full blocks.
    assert turn2.finish.usage.cached_tokens == 40
    assert_same_stream(uncached(tiny_llama, turn2_prompt, greedy()), turn2)


def second_turn_after_leaving_a_padded_batch(core: EngineCore) -> tuple[list[int], Collected]:
    """Turn 1 (30 prompt + 17 generated tokens) beside a longer and a shorter neighbour, then turn 2 extending it on
    the same core: (turn 2's prompt, its result)."""
    turn1_prompt = words(30, seed=8)
    arrivals = [
        Arrival(0, Request("long", words(61, seed=9), greedy(30))),
        Arrival(1, Request("t1", turn1_prompt, greedy(17))),
        Arrival(2, Request("short", words(5, seed=10), greedy(30))),
    ]
    turn1 = run_core(core, arrivals)["t1"]
    turn2_prompt = turn1_prompt + turn1.token_ids + [11, 12, 13]
    return turn2_prompt, run_core(core, [Arrival(0, Request("t2", turn2_prompt, greedy()))])["t2"]


def test_conversations_sharing_a_prefix_never_see_each_others_tokens(tiny_llama):
    prefix = words(48, seed=3)
    a_prompt, b_prompt = prefix + words(20, seed=4), prefix + words(20, seed=5)
    core = cached_core(tiny_llama)
    run_core(core, [Arrival(0, Request("a", a_prompt, greedy(20)))])
    b = run_core(core, [Arrival(0, Request("b", b_prompt, greedy(20)))])["b"]
    assert b.finish.usage.cached_tokens == 48
    assert_same_stream(uncached(tiny_llama, b_prompt, greedy(20)), b)
    # And concurrently, with chunked prefill, in one batch.
    core = cached_core(tiny_llama, prefill_chunk_tokens=16)
    both = run_core(core, [Arrival(0, Request("a", a_prompt, greedy(20))), Arrival(3, Request("b", b_prompt, greedy(20)))])
    assert_same_stream(uncached(tiny_llama, a_prompt, greedy(20)), both["a"])
    assert_same_stream(uncached(tiny_llama, b_prompt, greedy(20)), both["b"])


def test_same_prompt_requests_admitted_later_hit_the_first_ones_prompt(tiny_llama):
    prompt = words(90, seed=6)
    core = cached_core(tiny_llama, max_prefill_seqs=1)
    results = run_core(core, [Arrival(0, Request(f"r{i}", prompt, greedy(6))) for i in range(4)])
    # One prompt a step: each later one hits the blocks the step before it cached.
    assert [results[f"r{i}"].finish.usage.cached_tokens for i in range(4)] == [0, 88, 88, 88]
    reference = uncached(tiny_llama, prompt, greedy(6))
    for result in results.values():
        assert_same_stream(reference, result)


def test_new_prompts_reach_the_device_before_the_last_steps_prompts_are_copied(tiny_llama, monkeypatch):
    """Copying a step's prompts into the prefix cache costs CPU time (~15 ms for 32 prompts on an H100)
    that the next step's new prompts would wait for: they go first, unless one may hit those prompts
    (same first block), which then waits for the copies and hits them."""
    import engine.runner.runner as runner_module

    core = cached_core(tiny_llama)
    blocks_at_prefill: list[int] = []  # cached blocks when each step's prompts were dispatched
    real_run_prefill = runner_module.run_prefill

    def observed_run_prefill(*args, **kwargs):
        blocks_at_prefill.append(core.runner.prefix_cache.stats.num_blocks)
        return real_run_prefill(*args, **kwargs)

    monkeypatch.setattr(runner_module, "run_prefill", observed_run_prefill)
    a, b = words(40, seed=1), words(40, seed=2)
    c = b[:3 * BLOCK] + words(16, seed=3)  # shares b's first three blocks
    arrivals = [Arrival(0, Request("a", a, greedy(4))), Arrival(1, Request("b", b, greedy(4))),
                Arrival(2, Request("c", c, greedy(4)))]
    results = run_core(core, arrivals)
    # b went to the device before a's five blocks were copied; c after b's five, and hit three of them.
    assert blocks_at_prefill == [0, 0, 10]
    assert [results[r].finish.usage.cached_tokens for r in "abc"] == [0, 0, 3 * BLOCK]
    for name, prompt in zip("abc", (a, b, c)):
        assert_same_stream(uncached(tiny_llama, prompt, greedy(4)), results[name])
    core.runner.prefix_cache.check_integrity()
    assert core.runner.prefix_cache.stats.num_blocks == 12  # five of a, five of b, two new of c


def test_byte_budget_holds_over_many_distinct_prompts(tiny_llama):
    budget = 1 << 20  # the tiny model's KV is 512 bytes per token: 24 prompts of 200 tokens need 2.4 MiB
    core = cached_core(tiny_llama, prefix_cache_bytes=budget)
    arrivals = [Arrival(i, Request(f"r{i}", words(200, seed=100 + i), greedy(4))) for i in range(24)]
    run_core(core, arrivals)
    cache = core.runner.prefix_cache
    cache.check_integrity()
    assert 0 < cache.stats.bytes_used <= budget and cache.stats.evictions > 0


@pytest.fixture(scope="module", params=["gemma3_sliding", "qwen3_next_hybrid"])
def uncuttable_model(request, tmp_path_factory, wordlevel_tokenizer_dir):
    from engine.models.loader import load_model
    from tests.engine.test_architectures import GEMMA3_SLIDING, QWEN3_NEXT_HYBRID
    from tests.support.tiny_models import write_model

    config = {"gemma3_sliding": GEMMA3_SLIDING, "qwen3_next_hybrid": QWEN3_NEXT_HYBRID}[request.param]
    return load_model(write_model(tmp_path_factory.mktemp(request.param), config, wordlevel_tokenizer_dir, scale=3.0))


def test_sliding_window_and_hybrid_models_hit_snapshots_and_stay_exact(uncuttable_model):
    core = cached_core(uncuttable_model, prefill_chunk_tokens=12)
    assert core.runner.prefix_cache.snapshot_only
    turn1_prompt = words(37, seed=7)  # snapshot at 32 tokens (4 blocks)
    turn1 = run_core(core, [Arrival(0, Request("t1", turn1_prompt, greedy(12)))])["t1"]
    assert_same_stream(uncached(uncuttable_model, turn1_prompt, greedy(12)), turn1)
    turn2_prompt = turn1_prompt + turn1.token_ids + [5, 6, 7]
    turn2 = run_core(core, [Arrival(0, Request("t2", turn2_prompt, greedy(12)))])["t2"]
    assert turn2.finish.usage.cached_tokens == 32
    assert_same_stream(uncached(uncuttable_model, turn2_prompt, greedy(12)), turn2)
    # A prompt that diverges inside the snapshot's blocks must not use it.
    other = turn1_prompt[:20] + words(30, seed=8)
    diverged = run_core(core, [Arrival(0, Request("o", other, greedy(8)))])["o"]
    assert diverged.finish.usage.cached_tokens == 0
    assert_same_stream(uncached(uncuttable_model, other, greedy(8)), diverged)
    core.runner.prefix_cache.check_integrity()
