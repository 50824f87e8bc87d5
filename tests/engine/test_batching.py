"""Continuous batching is invisible to each request: batched == alone, chunked == one-shot."""

from __future__ import annotations

import random
import re

import pytest

from engine import EngineConfig, EngineCore, Request, SamplingParams
from engine.decode_warmup import warm_decode_batch
from engine.runner.decode_batch import FINISHING_STEPS
from tests.support.drive import Arrival, Collected, collect, run_core

LOGPROB_TOLERANCE = 1e-4


def random_prompts(count: int, seed: int = 0, max_len: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(250) for _ in range(rng.randrange(1, max_len))] for _ in range(count)]


def params(index: int, max_tokens: int = 12) -> SamplingParams:
    """Alternate greedy and seeded random sampling, with assorted filters."""
    if index % 2 == 0:
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=True)
    return SamplingParams(
        max_tokens=max_tokens, temperature=0.9, top_p=0.9 if index % 3 else 1.0,
        top_k=20 if index % 5 == 1 else 0, seed=1000 + index, ignore_eos=True, logprobs=True,
    )


def run_alone(loaded, request_id: str, prompt: list[int], sampling: SamplingParams, **config):
    core = EngineCore(loaded, EngineConfig(**config))
    return run_core(core, [Arrival(0, Request(request_id, prompt, sampling))])[request_id]


def assert_same_stream(alone, batched):
    assert batched.token_ids == alone.token_ids
    assert len(batched.logprobs) == len(alone.logprobs) > 0
    assert max(abs(a - b) for a, b in zip(alone.logprobs, batched.logprobs)) < LOGPROB_TOLERANCE
    assert batched.finish.reason == alone.finish.reason


def test_sixteen_staggered_requests_match_each_run_alone(tiny_llama):
    prompts = random_prompts(16)
    arrivals = [Arrival(i // 2, Request(f"r{i}", prompts[i], params(i))) for i in range(16)]
    core = EngineCore(tiny_llama, EngineConfig(max_prefill_seqs=3, prefill_chunk_tokens=16, max_decode_seqs=16))
    batched = run_core(core, arrivals)
    for i in range(16):
        alone = run_alone(tiny_llama, f"r{i}", prompts[i], params(i))
        assert_same_stream(alone, batched[f"r{i}"])
    # The batch really was shared: decode steps are far fewer than the tokens produced.
    assert core.stats().num_steps < 16 * 12 / 3


def test_requests_join_and_leave_without_waiting_for_the_batch_to_drain(tiny_llama):
    core = EngineCore(tiny_llama, EngineConfig(max_decode_seqs=8))
    core.add_request(Request("long", [1, 2, 3], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)))
    for _ in range(5):
        core.step()
    core.add_request(Request("short", [4, 5], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)))
    finished_at = {}
    for step in range(40):
        for output in core.step():
            if output.finish is not None:
                finished_at[output.request_id] = step
    assert finished_at["short"] < finished_at["long"] - 10
    # Every step is counted, with its wall time and the engine thread's CPU time inside it.
    stats = core.stats()
    assert stats.num_steps == 45
    assert stats.step_seconds_total > 0 and 0 < stats.step_cpu_seconds_total <= stats.step_seconds_total * 1.05 + 0.01
    # The step's wall time splits into its phases exactly; each step that decoded waited on the device for tokens.
    phases = stats.step_phases
    assert phases.schedule + phases.build + phases.wait + phases.output == pytest.approx(stats.step_seconds_total)
    assert min(phases.schedule, phases.build, phases.wait, phases.output) > 0


def test_a_step_past_the_slow_bound_is_logged_with_what_it_held(tiny_llama, caplog):
    """At the default bound a fast step is not logged; at 0 every step is, whatever the expected step time."""
    def two_steps(**config) -> list[str]:
        core = EngineCore(tiny_llama, EngineConfig(max_decode_seqs=8, **config))
        core.expected_step_s = 1.0  # 8 expected steps: 8 s
        core.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)))
        caplog.clear()
        with caplog.at_level("WARNING", logger="engine.core"):
            core.step()  # the prompt's prefill
            core.step()  # a decode step of one row
        return [r.getMessage() for r in caplog.records if r.name == "engine.core"]

    assert two_steps() == []  # fast on the tiny model
    first, second = two_steps(slow_step_log_seconds=0.0)
    assert first.startswith("slow step 1: ") and second.startswith("slow step 2: ")
    assert ": 0 decode rows, 1 new requests (0 with images), 1 prefill chunks of 3 tokens; MLX holds " in first, first
    assert ": 1 decode rows, 0 new requests (0 with images), 0 prefill chunks of 0 tokens; MLX holds " in second, second
    assert first.endswith("GiB limit") and re.search(r"holds \d+\.\d GiB active \+ \d+\.\d GiB cached", second), second


@pytest.mark.parametrize("chunk", [1, 5, 16])
def test_chunked_prefill_equals_one_shot_prefill(tiny_llama, chunk):
    prompt = random_prompts(1, seed=3, max_len=60)[0] + list(range(40))
    sampling = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=True)
    one_shot = run_alone(tiny_llama, "a", prompt, sampling, prefill_chunk_tokens=0)
    chunked = run_alone(tiny_llama, "a", prompt, sampling, prefill_chunk_tokens=chunk)
    assert_same_stream(one_shot, chunked)


def test_abort_mid_stream_leaves_the_others_unchanged(tiny_llama):
    prompts = random_prompts(4, seed=7)
    requests = lambda: [Request(f"r{i}", prompts[i], params(i, max_tokens=15)) for i in range(4)]
    core = EngineCore(tiny_llama, EngineConfig())
    reference = run_core(core, [Arrival(0, r) for r in requests()])
    core = EngineCore(tiny_llama, EngineConfig())
    aborted = run_core(core, [Arrival(0, r) for r in requests()], aborts={6: ["r1"]})
    assert aborted["r1"].finish.reason.value == "abort"
    assert 0 < len(aborted["r1"].token_ids) < 15
    for rid in ("r0", "r2", "r3"):
        assert_same_stream(reference[rid], aborted[rid])
    # The aborted request's KV is gone once the engine is idle.
    assert core.stats().kv_cache_bytes == 0


def test_seeded_sampling_is_reproducible_whatever_the_neighbours(tiny_llama):
    prompt = [5, 6, 7, 8]
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=42, ignore_eos=True, logprobs=True)
    alone = run_alone(tiny_llama, "s", prompt, seeded)
    neighbours = [Request(f"n{i}", p, params(i + 1)) for i, p in enumerate(random_prompts(6, seed=9))]
    core = EngineCore(tiny_llama, EngineConfig())
    batched = run_core(core, [Arrival(0, Request("s", prompt, seeded))] + [Arrival(i, r) for i, r in enumerate(neighbours)])
    assert_same_stream(alone, batched["s"])
    other_seed = run_alone(tiny_llama, "s", prompt, SamplingParams(max_tokens=16, temperature=1.0, seed=43, ignore_eos=True))
    assert other_seed.token_ids != alone.token_ids


@pytest.mark.parametrize("prompt_len", [1, 7, 40])
def test_greedy_stream_matches_mlx_lm_generate_step(tiny_llama, prompt_len):
    """An independent reference: mlx-lm's own single-stream loop gives the same tokens and logprobs
    (the first from the prefill's last position, the rest from decode steps)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    prompt = random_prompts(1, seed=prompt_len, max_len=prompt_len + 1)[0][:prompt_len]
    prompt = prompt + [7] * (prompt_len - len(prompt))
    sampling = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=True)
    ours = run_alone(tiny_llama, "r", prompt, sampling)
    reference = generate_step(mx.array(prompt, mx.uint32), tiny_llama.model, max_tokens=10)
    tokens, logprobs = zip(*((int(t), float(lp[t].item())) for t, lp in reference))
    assert ours.token_ids == list(tokens)
    assert max(abs(a - b) for a, b in zip(ours.logprobs, logprobs)) < LOGPROB_TOLERANCE


def test_the_decode_warm_up_runs_rows_joining_at_doubling_widths_and_leaves_the_core_untouched(tiny_llama):
    core = EngineCore(tiny_llama, EngineConfig(max_decode_seqs=8))
    assert warm_decode_batch(core) == 0  # the CPU builds no kernels at first use: no warm-up by default
    steps = warm_decode_batch(core, time_budget_s=60.0)
    # Widths 2, 4, 8: three steps each, then the rows left drain (answers of 3..6 tokens).
    assert 9 < steps < 30
    stats = core.stats()
    assert (stats.num_steps, stats.prompt_tokens_total, stats.generation_tokens_total) == (0, 0, 0)
    assert stats.prefix_cache.hits + stats.prefix_cache.misses == 0 and stats.kv_cache_bytes == 0
    prompt = [5, 6, 7, 8]
    sampling = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True)
    assert_same_stream(run_alone(tiny_llama, "a", prompt, sampling),
                       run_core(core, [Arrival(0, Request("a", prompt, sampling))])["a"])


def test_rows_that_leave_stay_in_the_kv_as_dead_rows_until_half_the_batch_is_dead(tiny_llama):
    # Removing a row copies every layer's whole KV; a dead row only costs a row of each step (decode_batch.py).
    prompts = random_prompts(9, seed=3)
    sampling = [params(i, max_tokens=4 + i) for i in range(8)]  # one row leaves each step
    core = gpu_batching_core(tiny_llama, max_prefill_seqs=8, max_decode_seqs=8)
    for i in range(8):
        core.add_request(Request(f"r{i}", prompts[i], sampling[i]))
    results: dict[str, Collected] = {}
    shapes = []  # (rows in the batch's KV, dead rows among them) after each step
    decoding = []  # what the engine's stats report decoding: the live rows
    late = Request("late", prompts[8], params(8, max_tokens=12))
    while core.has_unfinished_requests() or late is not None:
        if late is not None and core.runner.batch.num_dead_rows == 2:
            core.add_request(late)  # a joiner: written over a dead row
            late = None
        collect(core.step(), results)
        shapes.append((len(core.runner.batch), core.runner.batch.num_dead_rows))
        decoding.append(core.stats().num_decoding)
    # Rows leave one a step from the 4th and stay as dead rows (8, 3); the late request (prefilled the step after it
    # came) joins over a dead row as a 4th leaves (8, 3); one more stays dead (8, 4); a 5th would make 5 of 8 dead with
    # the late row's answer far from its end: the batch is rebuilt of its 3 live rows; one more stays dead; another
    # would make 2 of 3: the batch is rebuilt of the late row, which ends alone.
    assert shapes == [(0, 0), (8, 0), (8, 0), (8, 0), (8, 1), (8, 2), (8, 3), (8, 3), (8, 4), (3, 0), (3, 1)] + [
        (1, 0)] * 7 + [(0, 0)]
    assert decoding == [rows - dead for rows, dead in shapes]
    for i in range(8):
        assert_same_stream(run_alone(tiny_llama, f"r{i}", prompts[i], sampling[i]), results[f"r{i}"])
    assert_same_stream(run_alone(tiny_llama, "late", prompts[8], params(8, max_tokens=12)), results["late"])


def test_rows_ending_within_a_few_steps_stay_dead_past_half_the_batch(tiny_llama):
    # Rows of one burst end steps apart: once the live rows end within FINISHING_STEPS, no rebuild is worth its copy.
    prompts = random_prompts(6, seed=5)
    sampling = [params(i, max_tokens=6 + i) for i in range(6)]
    core = gpu_batching_core(tiny_llama, max_prefill_seqs=6, max_decode_seqs=6)
    results, shapes = run_observing(core, prompts, sampling, lambda batch: (len(batch), batch.num_dead_rows))
    # The 4th row to leave makes 4 of 6 dead while the last two rows have 1 and 2 tokens to go.
    assert FINISHING_STEPS >= 2
    assert shapes[-6:] == [(6, 1), (6, 2), (6, 3), (6, 4), (6, 5), (0, 0)]
    assert_each_as_alone(tiny_llama, prompts, sampling, results)


def test_prompts_completing_beside_a_rebuilt_batch_join_it_in_place_over_vacant_rows(tiny_llama):
    # Waves of two prompts: the batch is built for the first wave with two vacant rows for the second, prefilling
    # beside it, which is written into them the next step (one scatter, no copy of the batch's KV); the third wave
    # rebuilds it (no free rows) while rows decode, again with two vacant rows, which the fourth takes.
    prompts = random_prompts(8, seed=7)
    sampling = [params(i, max_tokens=12) for i in range(8)]
    core = gpu_batching_core(tiny_llama, max_prefill_seqs=2, max_decode_seqs=8)
    results, seen = run_observing(core, prompts, sampling, lambda batch: (
        (len(batch), batch.num_dead_rows), batch.caches[0].keys if batch.is_batched else None))
    shapes, buffers = [shape for shape, _ in seen], [keys for _, keys in seen]
    assert shapes[:5] == [(0, 0), (4, 2), (4, 0), (8, 2), (8, 0)]
    assert buffers[2] is buffers[1] and buffers[4] is buffers[3]  # filled in place (a rebuilt batch has new arrays)
    assert buffers[3] is not buffers[2]
    assert_each_as_alone(tiny_llama, prompts, sampling, results)


def test_a_batch_built_beside_longer_answers_keeps_their_room_so_they_join_in_place(tiny_llama):
    # Two short answers start the batch near mlx-lm's 256-position boundary while two long ones complete beside it:
    # its buffers take the long answers' room too (not the 256 boundary the short ones need), so they fill the
    # vacant rows in place and decode past 256 positions without a rebuild or growth.
    prompts = random_prompts(4, seed=9, max_len=2)
    prompts = [p * 240 for p in prompts]
    sampling = [params(i, max_tokens=3 if i < 2 else 40) for i in range(4)]
    core = gpu_batching_core(tiny_llama, max_prefill_seqs=2, max_decode_seqs=4)
    results, buffers = run_observing(core, prompts, sampling, lambda batch: (
        (batch.caches[0].keys, len(batch), batch.num_dead_rows) if batch.is_batched else None))
    assert buffers[0] is None and buffers[1][1:] == (4, 2) and buffers[2][1:] == (4, 0)
    assert all(b[0] is buffers[1][0] for b in buffers[1:8])  # the same buffers from the build on
    assert buffers[1][0].shape[2] == 288  # 240 + 41 positions, in whole WIDTH_QUANTUMs
    assert_each_as_alone(tiny_llama, prompts, sampling, results)


def run_observing(core: EngineCore, prompts: list[list[int]], sampling: list[SamplingParams], observe):
    """Requests r0, r1, ... added at once and run to the end: their streams, and observe(decode batch) after each
    step."""
    for i, (prompt, params_i) in enumerate(zip(prompts, sampling)):
        core.add_request(Request(f"r{i}", prompt, params_i))
    results: dict[str, Collected] = {}
    seen = []
    while core.has_unfinished_requests():
        collect(core.step(), results)
        seen.append(observe(core.runner.batch))
    return results, seen


def assert_each_as_alone(loaded, prompts: list[list[int]], sampling: list[SamplingParams], results) -> None:
    for i, (prompt, params_i) in enumerate(zip(prompts, sampling)):
        assert_same_stream(run_alone(loaded, f"r{i}", prompt, params_i), results[f"r{i}"])


def gpu_batching_core(loaded, **config) -> EngineCore:
    """A core whose decode batch keeps leaving rows as dead rows, as on a GPU (the CPU's choice is not to). No step
    token budget: prompts start max_prefill_seqs a step, in waves, also with nothing decoding (no burst)."""
    core = EngineCore(loaded, EngineConfig(prefill_chunk_tokens=512, prefill_step_tokens=0, **config))
    assert not core.runner.batch.defer_leaves  # the CPU's choice (runner.py); the GPU's, run here:
    core.runner.batch.defer_leaves = True
    return core


def test_rows_joining_near_a_step_boundary_decode_past_it_without_regrowing_the_batch(tiny_llama):
    # Prompts of ~250 tokens with 30 to generate cross mlx-lm's 256-position boundary: the joins reserve the rows'
    # room (kv/plain_batch.py), so the decode steps write into the same buffers, and the streams stay exact.
    prompts = [[7 + seed] * (246 + seed) for seed in range(4)]
    sampling = [params(i, max_tokens=30) for i in range(4)]
    requests = [Request(f"r{i}", prompts[i], sampling[i]) for i in range(4)]
    core = EngineCore(tiny_llama, EngineConfig(max_prefill_seqs=2, prefill_chunk_tokens=512, max_decode_seqs=4))
    results: dict[str, Collected] = {}
    buffers = []  # the first layer's key buffer after each step where all four rows decode
    for step in range(10_000):
        if step in (0, 2):  # two rows, then two more joining them two steps later
            core.add_request(requests[step])
            core.add_request(requests[step + 1])
        elif not core.has_unfinished_requests():
            break
        collect(core.step(), results)
        batch = core.runner.batch
        if len(batch) == 4 and batch.num_live_rows == 4:
            buffers.append(batch.caches[0].keys)
    width = buffers[0].shape[2]
    assert len(buffers) >= 25 and all(b is buffers[0] for b in buffers)  # written in place, never regrown
    assert width >= batch_index_after(prompts, 30) and width > 256
    for i in range(4):
        assert_same_stream(run_alone(tiny_llama, f"r{i}", prompts[i], sampling[i]), results[f"r{i}"])


def batch_index_after(prompts: list[list[int]], max_tokens: int) -> int:
    """The last KV position the longest row writes: its prompt, then one per sample but the last."""
    return max(len(p) for p in prompts) + max_tokens - 1
