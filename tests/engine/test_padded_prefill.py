"""Padded prefill shapes (the GPU default) are invisible to each request: padded == unpadded."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

from engine import EngineConfig, EngineCore, Request, SamplingParams
import engine.runner.plain_prefill as plain_prefill_module
import engine.runner.prefill as prefill_module
from engine.kv.batch_cache import new_request_cache
from engine.runner.prefill_shapes import warmup_shapes
from engine.runner.warmup import warm_prefill_shapes
from tests.engine.test_batching import assert_same_stream, params, random_prompts, run_alone
from tests.engine.test_prefix_cache_engine import greedy, uncached, words
from tests.support.drive import Arrival, run_core

PADDED = dict(pad_prefill_shapes=True, prefill_warmup_seconds=0)


def whole_head_core(loaded, config: EngineConfig) -> EngineCore:
    """A core computing prefill logits through the model's own call (no head split): the path of
    models whose head cannot be split, where the logits budget applies."""
    core = EngineCore(loaded, config)
    assert core.runner.head_split is not None  # llama splits; this turns it off
    core.runner.head_split = None
    return core


@contextlib.contextmanager
def logits_budget(elements: int) -> Iterator[None]:
    """Full logits of at most `elements` per forward (plain_prefill's budget) inside the block."""
    budget = plain_prefill_module.LOGITS_ELEMENTS_BUDGET
    plain_prefill_module.LOGITS_ELEMENTS_BUDGET = elements
    try:
        yield
    finally:
        plain_prefill_module.LOGITS_ELEMENTS_BUDGET = budget


@contextlib.contextmanager
def recorded_forwards() -> Iterator[list[tuple[int, int, bool]]]:
    """Each padded forward run inside the block: (rows, padded rows, whether the head was split)."""
    forwards: list[tuple[int, int, bool]] = []
    real_plain_prefill = plain_prefill_module.plain_prefill

    def recording_plain_prefill(model, chunks, caches, vocab_size, padded_rows=0, split=None):
        forwards.append((len(chunks), padded_rows, split is not None))
        return real_plain_prefill(model, chunks, caches, vocab_size, padded_rows, split)

    prefill_module.plain_prefill = recording_plain_prefill
    try:
        yield forwards
    finally:
        prefill_module.plain_prefill = real_plain_prefill


def assert_each_matches_alone(loaded, new_core: Callable[[], EngineCore], named_prompts) -> None:
    """Each (name, prompts) set arrives at once on a fresh core; every request equals its unpadded single run."""
    for name, prompts in named_prompts:
        arrivals = [Arrival(0, Request(f"{name}{i}", p, params(i))) for i, p in enumerate(prompts)]
        batched = run_core(new_core(), arrivals)
        for i, prompt in enumerate(prompts):
            alone = run_alone(loaded, f"{name}{i}", prompt, params(i), pad_prefill_shapes=False)
            assert_same_stream(alone, batched[f"{name}{i}"])


def test_padded_staggered_requests_match_each_run_alone_unpadded(tiny_llama):
    # Lengths 1-69 and chunks of 24 give ragged rows, several buckets and split groups.
    prompts = random_prompts(12, seed=11, max_len=70)
    arrivals = [Arrival(i // 3, Request(f"r{i}", prompts[i], params(i))) for i in range(12)]
    config = EngineConfig(max_prefill_seqs=4, prefill_chunk_tokens=24, prefill_step_tokens=64, **PADDED)
    core = EngineCore(tiny_llama, config)
    assert core.runner.pad_prefill_shapes
    batched = run_core(core, arrivals)
    for i in range(12):
        alone = run_alone(tiny_llama, f"r{i}", prompts[i], params(i), pad_prefill_shapes=False)
        assert_same_stream(alone, batched[f"r{i}"])


def test_padded_whole_prompt_prefill_matches_unpadded(tiny_llama):
    prompt = random_prompts(1, seed=5, max_len=60)[0] + list(range(37))
    sampling = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=True)
    unpadded = run_alone(tiny_llama, "a", prompt, sampling, prefill_chunk_tokens=0, pad_prefill_shapes=False)
    padded = run_alone(tiny_llama, "a", prompt, sampling, prefill_chunk_tokens=0, **PADDED)
    assert_same_stream(unpadded, padded)


def test_padded_prefix_cache_hit_matches_no_cache(tiny_llama):
    shared = words(70, seed=1)
    core = EngineCore(tiny_llama, EngineConfig(prefix_block_size=8, **PADDED))
    run_core(core, [Arrival(0, Request("first", shared + [3, 4, 5], greedy()))])
    second_prompt = shared + [9, 8, 7, 6]
    hit = run_core(core, [Arrival(0, Request("second", second_prompt, greedy()))])["second"]
    assert hit.finish.usage.cached_tokens == 64
    assert_same_stream(uncached(tiny_llama, second_prompt, greedy()), hit)


def test_prompts_cached_together_from_one_padded_forward_serve_later_hits_exactly(tiny_llama):
    # Three prompts of different lengths and prefixes complete in one padded forward (at a nonzero
    # shared cache offset for their second chunks); their blocks are copied from that forward's
    # batch at once. Each later request extending one of them must hit its own rows' KV.
    prompts = [words(45, seed=31), words(60, seed=32), words(38, seed=33)]
    core = EngineCore(tiny_llama, EngineConfig(prefix_block_size=8, prefill_chunk_tokens=16, **PADDED))
    run_core(core, [Arrival(0, Request(f"p{i}", p, greedy(2))) for i, p in enumerate(prompts)])
    for i, prompt in enumerate(prompts):
        follow_up = prompt + [5, 6, 7]
        hit = run_core(core, [Arrival(0, Request(f"f{i}", follow_up, greedy()))])[f"f{i}"]
        assert hit.finish.usage.cached_tokens == (len(prompt) // 8) * 8
        assert_same_stream(uncached(tiny_llama, follow_up, greedy()), hit)


def test_warmup_runs_every_shape_and_leaves_no_state(tiny_llama):
    config = EngineConfig(max_prefill_seqs=2, prefill_chunk_tokens=32, prefill_step_tokens=64, pad_prefill_shapes=True)
    vocab = tiny_llama.vocab_size
    shapes = warmup_shapes(config.max_prefill_seqs, config.prefill_token_budget, config.prefill_chunk_limit)
    assert [(s.rows, s.length, s.completing) for s in shapes] == [
        (1, 16, True), (1, 16, False), (1, 32, True), (1, 32, False),
        (2, 16, True), (2, 16, False), (2, 32, True), (2, 32, False),
    ]
    core = EngineCore(tiny_llama, config)
    ran = warm_prefill_shapes(core.runner.model, shapes, lambda: new_request_cache(core.runner.model), 60.0, vocab, 2)
    assert ran == len(shapes)
    core.runner.warmup()
    assert not core.runner.holds_state() and core.runner.kv_cache_bytes() == 0
    prompt = random_prompts(1, seed=9, max_len=40)[0]
    after = run_core(core, [Arrival(0, Request("a", prompt, params(0)))])["a"]
    assert_same_stream(run_alone(tiny_llama, "a", prompt, params(0)), after)


def test_warmup_stops_at_its_time_budget(tiny_llama):
    vocab = tiny_llama.vocab_size
    shapes = warmup_shapes(8, 8192, 2048)
    model = tiny_llama.model
    assert warm_prefill_shapes(model, shapes, lambda: new_request_cache(model), 0.0, vocab, 8) == 0
    assert 1 <= warm_prefill_shapes(model, shapes, lambda: new_request_cache(model), 0.05, vocab, 8) < len(shapes)


def test_plain_batches_match_each_request_alone(tiny_llama):
    """A burst of equal prompts (body + tail), ragged completions under a tiny logits budget (split
    forwards), and second chunks sharing a nonzero cache offset, all equal to unpadded single runs."""
    equal = random_prompts(1, seed=21, max_len=40)[0] * 2
    ragged = [p + [7] * 20 for p in random_prompts(5, seed=22, max_len=30)]
    prompts = [equal[:50]] * 3 + ragged + [list(range(1, 60)), list(range(2, 61))]
    arrivals = [Arrival(0, Request(f"r{i}", prompts[i], params(i))) for i in range(len(prompts))]
    config = EngineConfig(max_prefill_seqs=16, prefill_chunk_tokens=32, prefill_step_tokens=1024, **PADDED)
    core = whole_head_core(tiny_llama, config)
    # Two 32-wide rows of full logits per forward: ragged completions split, equal ones take body + tail.
    with logits_budget(2 * 32 * tiny_llama.vocab_size):
        batched = run_core(core, arrivals)
    for i, prompt in enumerate(prompts):
        alone = run_alone(tiny_llama, f"r{i}", prompt, params(i), pad_prefill_shapes=False)
        assert_same_stream(alone, batched[f"r{i}"])


def test_equal_prompts_over_the_logits_budget_write_bodies_then_one_token(tiny_llama):
    prompt = random_prompts(1, seed=23, max_len=40)[0] + list(range(5, 25))
    arrivals = [Arrival(0, Request(f"e{i}", prompt, params(i))) for i in range(3)]
    core = whole_head_core(tiny_llama, EngineConfig(max_prefill_seqs=4, prefill_chunk_tokens=0, **PADDED))
    with logits_budget(tiny_llama.vocab_size):  # full logits of one position only
        batched = run_core(core, arrivals)
    for i in range(3):
        assert_same_stream(run_alone(tiny_llama, f"e{i}", prompt, params(i), pad_prefill_shapes=False), batched[f"e{i}"])


def test_filler_rows_up_to_a_row_bucket_are_invisible(tiny_llama):
    """Twelve rows run as fifteen (three filler rows), at offset 0 and again at a nonzero shared offset;
    ten equal prompts over the logits budget take body + tail with one filler. All equal to single runs."""
    ragged = [p + [9] * 20 for p in random_prompts(12, seed=41, max_len=10)]  # 21-30 tokens: two chunks
    equal = [random_prompts(1, seed=42, max_len=30)[0] + list(range(3, 13))] * 10
    config = EngineConfig(max_prefill_seqs=16, prefill_chunk_tokens=16, prefill_step_tokens=1024, **PADDED)
    # Full logits of one position only: the equal prompts take body + tail.
    with logits_budget(tiny_llama.vocab_size), recorded_forwards() as recorded:
        assert_each_matches_alone(tiny_llama, lambda: whole_head_core(tiny_llama, config), (("r", ragged), ("e", equal)))
    forwards = [(rows, padded) for rows, padded, _ in recorded]
    assert (12, 15) in forwards and (10, 11) in forwards


def test_split_head_bursts_match_each_request_alone_in_one_forward(tiny_llama):
    """With the head split (llama's default), equal and ragged completions of one step run as one
    forward each, whatever the logits budget, and still equal unpadded single runs."""
    equal = [random_prompts(1, seed=51, max_len=30)[0] + list(range(3, 13))] * 6
    ragged = [p + [5] * 12 for p in random_prompts(6, seed=52, max_len=12)]
    config = EngineConfig(max_prefill_seqs=16, prefill_chunk_tokens=0, prefill_step_tokens=1024, **PADDED)
    # A budget of one position's logits would force body + tail, or splits, without the head split.
    with logits_budget(tiny_llama.vocab_size), recorded_forwards() as recorded:
        assert_each_matches_alone(tiny_llama, lambda: EngineCore(tiny_llama, config), (("e", equal), ("g", ragged)))
    assert all(split for _, _, split in recorded)
    forwards = [rows for rows, _, _ in recorded]
    assert forwards == [6, 6]
