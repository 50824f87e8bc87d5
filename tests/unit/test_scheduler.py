"""Scheduler: exact per-step token counts, admission limits, abort, queue full / timeout (no MLX)."""

from __future__ import annotations

import sys

import pytest

from engine.config import EngineConfig
from engine.errors import QueueFullError, QueueTimeoutError
from engine.kv.cache_manager import KVCacheManager, PrefixCache
from engine.request import Request, RequestStatus
from engine.sampling.guided import GuidedDecoding
from engine.sampling.params import SamplingParams
from engine.scheduler import Scheduler


def make_request(rid: str, prompt_len: int, max_tokens: int = 4, arrival: float = 0.0) -> Request:
    return Request(rid, list(range(prompt_len)), SamplingParams(max_tokens=max_tokens), arrival_time=arrival)


def step_counts(scheduler: Scheduler) -> tuple[dict[str, int], dict[str, int]]:
    """Schedule one step, then finish requests whose last decode was dispatched (as the core would)."""
    out = scheduler.schedule()
    prefill = {c.request_id: c.num_tokens for c in out.prefill_chunks}
    decode = {r.request_id: 1 for r in out.decode_rows}
    for request in list(scheduler.running):
        if not request.is_prefilling and not request.wants_more_decode_steps:
            scheduler.finish_request(request, RequestStatus.FINISHED_LENGTH)
    return prefill, decode


def test_chunked_prefill_splits_a_prompt_by_the_token_budget():
    scheduler = Scheduler(EngineConfig(prefill_chunk_tokens=8))
    scheduler.add_request(make_request("a", prompt_len=21, max_tokens=3))
    # All 21 prompt tokens are prefilled; the completing chunk samples the first of the 3 tokens.
    assert step_counts(scheduler) == ({"a": 8}, {})
    assert step_counts(scheduler) == ({"a": 8}, {})
    assert step_counts(scheduler) == ({"a": 5}, {})
    assert step_counts(scheduler) == ({}, {"a": 1})
    assert step_counts(scheduler) == ({}, {"a": 1})
    assert not scheduler.has_unfinished_requests()


def test_long_prefill_shares_steps_with_running_decodes():
    scheduler = Scheduler(EngineConfig(prefill_chunk_tokens=10))
    scheduler.add_request(make_request("d1", prompt_len=1, max_tokens=10))
    scheduler.add_request(make_request("d2", prompt_len=1, max_tokens=10))
    assert step_counts(scheduler) == ({"d1": 1, "d2": 1}, {})  # one-token prompts sample at once
    scheduler.add_request(make_request("long", prompt_len=31, max_tokens=2))
    assert step_counts(scheduler) == ({"long": 10}, {"d1": 1, "d2": 1})
    assert step_counts(scheduler) == ({"long": 10}, {"d1": 1, "d2": 1})
    assert step_counts(scheduler) == ({"long": 10}, {"d1": 1, "d2": 1})
    assert step_counts(scheduler) == ({"long": 1}, {"d1": 1, "d2": 1})
    assert step_counts(scheduler) == ({}, {"d1": 1, "d2": 1, "long": 1})


def test_budget_is_shared_first_come_first_served():
    scheduler = Scheduler(EngineConfig(prefill_chunk_tokens=10, prefill_step_tokens=10, max_prefill_seqs=4))
    for rid, n in (("a", 7), ("b", 7), ("c", 7)):
        scheduler.add_request(make_request(rid, prompt_len=n, max_tokens=1))
    # max_tokens=1: each request's only token comes from its completing chunk, no decode step.
    assert step_counts(scheduler) == ({"a": 7, "b": 3}, {})
    assert step_counts(scheduler) == ({"b": 4, "c": 6}, {})
    assert step_counts(scheduler) == ({"c": 1}, {})
    assert not scheduler.has_unfinished_requests()


def test_each_request_takes_at_most_one_chunk_of_the_step_budget():
    scheduler = Scheduler(EngineConfig(prefill_chunk_tokens=8, prefill_step_tokens=20, max_prefill_seqs=4))
    for rid in ("a", "b", "c"):
        scheduler.add_request(make_request(rid, prompt_len=12, max_tokens=1))
    assert step_counts(scheduler) == ({"a": 8, "b": 8, "c": 4}, {})
    assert step_counts(scheduler) == ({"a": 4, "b": 4, "c": 8}, {})
    assert not scheduler.has_unfinished_requests()


def test_step_budget_zero_leaves_only_chunks_and_max_prefill_seqs():
    scheduler = Scheduler(EngineConfig(prefill_chunk_tokens=100, prefill_step_tokens=0, max_prefill_seqs=3))
    for rid in ("a", "b", "c", "d"):
        scheduler.add_request(make_request(rid, prompt_len=150, max_tokens=1))
    assert step_counts(scheduler) == ({"a": 100, "b": 100, "c": 100}, {})
    assert step_counts(scheduler) == ({"a": 50, "b": 50, "c": 50}, {})
    assert step_counts(scheduler) == ({"d": 100}, {})
    assert step_counts(scheduler) == ({"d": 50}, {})


def test_chunking_disabled_prefills_whole_prompts():
    scheduler = Scheduler(EngineConfig(prefill_chunk_tokens=0))
    scheduler.add_request(make_request("a", prompt_len=5000, max_tokens=1))
    assert step_counts(scheduler) == ({"a": 5000}, {})
    assert not scheduler.has_unfinished_requests()


def test_max_prefill_seqs_limits_requests_starting_per_step():
    scheduler = Scheduler(EngineConfig(max_prefill_seqs=2))
    for i in range(5):
        scheduler.add_request(make_request(f"r{i}", prompt_len=4, max_tokens=1))
    assert step_counts(scheduler) == ({"r0": 4, "r1": 4}, {})
    assert step_counts(scheduler) == ({"r2": 4, "r3": 4}, {})
    assert step_counts(scheduler) == ({"r4": 4}, {})
    assert not scheduler.has_unfinished_requests()


def test_with_nothing_decoding_a_burst_up_to_max_decode_seqs_starts_within_the_step_token_budget():
    # Its rows then decode at one length (issue 57); beside decode rows max_prefill_seqs applies again.
    scheduler = Scheduler(EngineConfig(max_prefill_seqs=2, max_decode_seqs=8, prefill_step_tokens=20))
    for i in range(6):
        scheduler.add_request(make_request(f"r{i}", prompt_len=4, max_tokens=3))
    assert step_counts(scheduler) == ({f"r{i}": 4 for i in range(5)}, {})  # 20 tokens: the budget, not 2 seqs
    for i in range(6, 9):
        scheduler.add_request(make_request(f"r{i}", prompt_len=4, max_tokens=3))
    assert step_counts(scheduler) == ({"r5": 4, "r6": 4}, {f"r{i}": 1 for i in range(5)})
    assert step_counts(scheduler) == ({"r7": 4}, {f"r{i}": 1 for i in range(7)})  # 8 running: the decode limit


def test_a_burst_leaves_prompts_sharing_a_first_block_with_its_own_to_a_later_step_to_hit_the_cache():
    kv = KVCacheManager(PrefixCache(block_size=4, capacity_bytes=100))
    scheduler = Scheduler(EngineConfig(max_prefill_seqs=2, max_decode_seqs=8, prefill_step_tokens=64), kv=kv)
    prompts = {"a": [1, 2, 3, 4, 5], "b": [1, 2, 3, 4, 6], "c": [9, 9, 9, 9], "d": [1, 2, 3, 4, 7], "e": [8, 8]}
    for rid, prompt in prompts.items():
        scheduler.add_request(Request(rid, prompt, SamplingParams(max_tokens=3)))
    # a and b are within max_prefill_seqs, as before; d (like a) ends the burst where it queues.
    assert step_counts(scheduler) == ({"a": 5, "b": 5, "c": 4}, {})
    assert [r.request_id for r in scheduler.waiting] == ["d", "e"]


def test_max_decode_seqs_bounds_running_requests():
    scheduler = Scheduler(EngineConfig(max_decode_seqs=2, max_prefill_seqs=8))
    for i, max_tokens in enumerate((1, 3, 3)):
        scheduler.add_request(make_request(f"r{i}", prompt_len=2, max_tokens=max_tokens))
    assert step_counts(scheduler) == ({"r0": 2, "r1": 2}, {})
    assert scheduler.num_waiting == 1
    # r0 finished with its first token, so r2 is admitted while r1 keeps decoding.
    assert step_counts(scheduler) == ({"r2": 2}, {"r1": 1})
    assert step_counts(scheduler) == ({}, {"r1": 1, "r2": 1})
    assert step_counts(scheduler) == ({}, {"r2": 1})
    assert not scheduler.has_unfinished_requests()


def test_abort_frees_running_kv_next_step_and_drops_waiting():
    scheduler = Scheduler(EngineConfig(max_decode_seqs=1))
    running, waiting = make_request("run", 3, max_tokens=9), make_request("wait", 3)
    scheduler.add_request(running)
    scheduler.add_request(waiting)
    assert step_counts(scheduler) == ({"run": 3}, {})
    scheduler.finish_request(running, RequestStatus.FINISHED_ABORTED)
    scheduler.finish_request(waiting, RequestStatus.FINISHED_ABORTED)
    out = scheduler.schedule()
    assert out.freed_request_ids == ["run"]
    assert out.prefill_chunks == [] and out.decode_rows == []
    assert running.status == waiting.status == RequestStatus.FINISHED_ABORTED
    assert not scheduler.has_unfinished_requests()
    assert scheduler.schedule().freed_request_ids == []


def test_queue_full_is_refused_with_a_typed_error():
    scheduler = Scheduler(EngineConfig(max_num_seqs=2))
    scheduler.add_request(make_request("a", 3))
    scheduler.add_request(make_request("b", 3))
    with pytest.raises(QueueFullError, match="max_num_seqs=2"):
        scheduler.add_request(make_request("c", 3))


def test_queue_size_counts_only_requests_that_must_wait():
    scheduler = Scheduler(EngineConfig(max_decode_seqs=2, queue_size=1))
    scheduler.add_request(make_request("a", 3))
    scheduler.add_request(make_request("b", 3))  # both fit in free running slots
    scheduler.add_request(make_request("c", 3))  # the one queued request
    with pytest.raises(QueueFullError, match="queue_size=1"):
        scheduler.add_request(make_request("d", 3))


def test_queue_timeout_expires_waiting_requests_with_an_error():
    now = [0.0]
    scheduler = Scheduler(EngineConfig(max_decode_seqs=1, queue_timeout=5.0), clock=lambda: now[0])
    scheduler.add_request(make_request("a", 3, max_tokens=100, arrival=0.0))
    waiting_b = make_request("b", 3, arrival=0.0)
    scheduler.add_request(waiting_b)
    assert step_counts(scheduler) == ({"a": 3}, {})
    now[0] = 5.0
    assert scheduler.schedule().expired == []
    now[0] = 5.5
    out = scheduler.schedule()
    assert [r.request_id for r in out.expired] == ["b"]
    assert isinstance(out.expired[0].error, QueueTimeoutError)
    assert waiting_b.status == RequestStatus.FINISHED_ERROR
    assert [r.request_id for r in out.decode_rows] == ["a"]


def test_one_token_prompt_samples_its_first_token_in_its_prefill_step():
    scheduler = Scheduler(EngineConfig())
    scheduler.add_request(make_request("a", 1, max_tokens=3))
    assert step_counts(scheduler) == ({"a": 1}, {})
    assert step_counts(scheduler) == ({}, {"a": 1})
    assert step_counts(scheduler) == ({}, {"a": 1})
    assert not scheduler.has_unfinished_requests()


def test_scheduler_does_not_import_mlx():
    import subprocess

    code = "import engine.scheduler, sys; print('mlx.core' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_draft_allowances_stop_at_max_tokens_and_accepted_drafts_count_as_computed():
    from engine.spec_decode.config import SpeculativeConfig

    scheduler = Scheduler(EngineConfig(speculative=SpeculativeConfig(num_draft_tokens=4)))
    scheduler.add_request(make_request("a", prompt_len=6, max_tokens=9))
    scheduler.add_request(Request("off", [1, 2, 3], SamplingParams(max_tokens=9), speculative=False))
    scheduler.schedule()  # both prompts complete: their first tokens
    rows = {r.request_id: r for r in scheduler.schedule().decode_rows}
    assert (rows["a"].max_draft_tokens, rows["off"].max_draft_tokens) == (4, 0)
    a = rows["a"]
    scheduler.accept_drafts({"a": 3})  # 3 drafts + the target's token: 4 more tokens, all in the KV but the last
    request = scheduler.running[0]
    assert (request.num_decode_steps, request.num_computed_tokens) == (5, 6 + 1 + 3)
    row = next(r for r in scheduler.schedule().decode_rows if r.request_id == "a")
    assert row.sample_index == a.sample_index + 4 and row.max_draft_tokens == 9 - 6  # never past max_tokens


def test_a_request_as_submitted_keeps_its_inputs_and_drops_its_progress():
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=4), prompt_cache_keys=[7, 8, 9], speculative=False)
    request.num_computed_tokens, request.num_decode_steps = 3, 2
    request.append_output_token(5)
    copy = request.as_submitted()
    assert (copy.prompt_token_ids, copy.prompt_cache_keys, copy.speculative, copy.sampling) == ((1, 2, 3), (7, 8, 9), False, request.sampling)
    assert (copy.num_computed_tokens, copy.num_decode_steps, copy.output_token_ids) == (0, 0, ())


def test_a_prefix_hit_reaches_the_runner_as_block_hashes_of_blocks_locked_until_the_request_ends():
    cache = PrefixCache(block_size=4, capacity_bytes=100)
    cache.insert(list(range(8)), lambda index: (("kv", index), 1))
    scheduler = Scheduler(EngineConfig(prefill_chunk_tokens=0), kv=KVCacheManager(cache))
    request = make_request("a", prompt_len=10)
    scheduler.add_request(request)
    (new,) = scheduler.schedule().new_requests
    blocks = [cache.block(block_hash) for block_hash in new.cached_block_hashes]
    assert [b.payload for b in blocks] == [("kv", 0), ("kv", 1)] and all(b.ref_count == 1 for b in blocks)
    scheduler.finish_request(request, RequestStatus.FINISHED_ABORTED)
    assert all(b.ref_count == 0 for b in blocks)


def test_a_guided_request_names_its_guide_by_key_held_from_arrival_until_it_finishes():
    scheduler = Scheduler(EngineConfig(prefill_chunk_tokens=0))
    guided = GuidedDecoding("regex", "[ab]+")
    compiled = object()  # a CompiledGuide to the scheduler: held, never looked into
    sampling = SamplingParams(max_tokens=4, guided=guided)
    requests = [Request(rid, [1, 2, 3], sampling, guide=compiled) for rid in ("a", "b")]
    for request in requests:
        scheduler.add_request(request)
    assert [new.guide_key for new in scheduler.schedule().new_requests] == [guided, guided]
    scheduler.finish_request(requests[0], RequestStatus.FINISHED_ABORTED)
    assert scheduler.guides.resolve(guided) is compiled  # the other request still holds it
    scheduler.finish_request(requests[1], RequestStatus.FINISHED_STOPPED)
    assert len(scheduler.guides) == 0


def test_an_image_prompts_tower_time_is_charged_to_the_step_of_its_first_chunk():
    """vision_cost_tokens (the vision tower's time, as the prompt tokens prefilled meanwhile) counts against the
    step budget at a request's first chunk only: two image prompts fill a step three text prompts would share."""
    scheduler = Scheduler(EngineConfig(prefill_chunk_tokens=64, prefill_step_tokens=100, max_prefill_seqs=8))
    for rid in ("a", "b", "c"):
        request = make_request(rid, prompt_len=30, max_tokens=1)
        request.vision_cost_tokens = 20
        scheduler.add_request(request)
    assert step_counts(scheduler) == ({"a": 30, "b": 30}, {})  # 2 x (30 + 20): the budget is spent
    assert step_counts(scheduler) == ({"c": 30}, {})

    long = make_request("long", prompt_len=80, max_tokens=1)
    long.vision_cost_tokens = 50
    scheduler.add_request(long)
    scheduler.add_request(make_request("text", prompt_len=30, max_tokens=1))
    assert step_counts(scheduler) == ({"long": 64}, {})  # 64 + 50 over the budget: the text prompt waits
    assert step_counts(scheduler) == ({"long": 16, "text": 30}, {})  # its later chunk pays no tower
    assert not scheduler.has_unfinished_requests()
