"""The KV budget in the scheduler (no MLX): the bytes it counts, who is preempted when, the front re-queue, what a
resumed request prefills and samples, admission that waits for KV, and a chunked prompt's KV step by step."""

from __future__ import annotations

import random

import pytest

from engine.config import EngineConfig
from engine.errors import KVBudgetExceededError
from engine.kv.budget import AdmissionHeadroom, KVBudget, KVPlan
from engine.request import Request, RequestStatus
from engine.sampling.params import SamplingParams
from engine.scheduler import Scheduler
from engine.scheduler_output import SchedulerOutput
from engine.spec_decode.config import SpeculativeConfig


class Driver:
    """Plays the core around a scheduler: a completing chunk's token is read in its own step, a decode row's in
    the next step, after that step is scheduled (pipelined decode); a request ends at max_tokens."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.requests: dict[str, Request] = {}
        self._in_flight: list[str] = []

    def add(self, request_id: str, prompt_len: int, max_tokens: int) -> Request:
        request = Request(request_id, list(range(prompt_len)), SamplingParams(max_tokens=max_tokens))
        self.requests[request_id] = request
        self.scheduler.add_request(request)
        return request

    def step(self) -> SchedulerOutput:
        out = self.scheduler.schedule()
        arrived = self._in_flight + [c.request_id for c in out.prefill_chunks if c.completes_prefill]
        self._in_flight = [row.request_id for row in out.decode_rows]
        for request_id in arrived:
            request = self.requests[request_id]
            if request.is_finished:
                continue
            request.append_output_token(1000 + request.num_output_tokens)
            if request.num_output_tokens == request.max_tokens:
                self.scheduler.finish_request(request, RequestStatus.FINISHED_LENGTH)
        return out


def one_byte_a_token(budget: int) -> Scheduler:
    """Budgets in tokens: one byte a token, no allocation step."""
    return Scheduler(EngineConfig(prefill_chunk_tokens=0), kv_budget=KVBudget(budget, 1, extra_positions=0))


def test_bytes_count_a_batch_at_its_longest_row_and_each_prefill_on_its_own():
    budget = KVBudget(10_000, 100, extra_positions=256)
    # Rows right-aligned at the longest (300): 3 x (300 + 256) positions; prefills their own length + 256.
    assert budget.bytes_of([10, 300, 20], [50, 0]) == (3 * 556 + 306) * 100
    assert budget.bytes_of([], []) == 0
    assert budget.max_request_tokens == 0  # 100 positions: less than one allocation step
    assert KVBudget(100_000, 100, extra_positions=256).max_request_tokens == 1000 - 256


def test_plan_sizing_and_admission_headroom_count_what_bytes_of_counts():
    """The scheduler's O(1) checks (a chunk search's lengths, a burst's admissions) against the plain count, over
    random plans: a chunk that sizing lets fit would fit by bytes_of, and so would an admitted request."""
    rng = random.Random(7)
    for _ in range(2000):
        budget = KVBudget(rng.randrange(1, 4000), rng.randrange(1, 4), extra_positions=rng.choice([0, 3, 16]))
        ids = [f"r{i}" for i in range(rng.randrange(0, 8))]
        plan = KVPlan(budget)
        for rid in ids:
            (plan.rows if rng.random() < 0.6 else plan.prefills)[rid] = rng.randrange(0, 300)
        rid, length, as_row = rng.choice([*ids, "new"]), rng.randrange(0, 400), rng.random() < 0.5
        rows, prefills = {k: v for k, v in plan.rows.items() if k != rid}, {k: v for k, v in plan.prefills.items() if k != rid}
        (rows if as_row else prefills)[rid] = length
        assert plan.sizing(rid).fits_with(length, as_row) == (
            budget.bytes_of(rows.values(), prefills.values()) <= budget.budget_bytes)
        headroom, lengths = AdmissionHeadroom(budget), [rng.randrange(1, 300) for _ in ids]
        for n in lengths:
            headroom.add(n)
        assert headroom.admits(length + 1) == (not lengths or budget.bytes_of([*lengths, length + 1], []) <= budget.budget_bytes)


def test_a_request_that_cannot_fit_alone_is_refused_naming_the_numbers():
    budget = KVBudget(1000 * 64, 64, extra_positions=256)  # 1000 positions: 744 tokens for one request
    budget.check_fits_alone(700, 44)
    with pytest.raises(KVBudgetExceededError) as refused:
        budget.check_fits_alone(700, 45)
    assert refused.value.param == "max_tokens" and refused.value.code == "kv_budget_exceeded"
    assert refused.value.message == (
        "The request needs KV for 745 tokens (700 in the prompt + 45 to generate) at 64 bytes per token, 64064 bytes "
        "with the cache's allocation step, but this model's KV budget is 64000 bytes (at most 744 tokens for one "
        "request)"
    )
    with pytest.raises(KVBudgetExceededError) as prompt_too_long:
        budget.check_fits_alone(800, 1)
    assert prompt_too_long.value.param == "messages"


def test_the_newest_request_is_preempted_requeued_first_and_resumes_by_recompute():
    scheduler = one_byte_a_token(60)
    driver = Driver(scheduler)
    a, b = driver.add("a", 4, 40), driver.add("b", 4, 40)
    first = driver.step()
    # Both fit with 16 tokens of headroom each (2 x 20 <= 60): both prefill at once.
    assert [(c.request_id, c.num_tokens) for c in first.prefill_chunks] == [("a", 4), ("b", 4)]
    # Two rows of L tokens take 2 x L: the step that would make L = 31 preempts the newest, b.
    for step in range(2, 28):
        out = driver.step()
        assert out.preempted_request_ids == [] and scheduler.kv_planned_bytes == 2 * (3 + step), step
    waiting = driver.add("c", 2, 2)  # arrived later: queued behind the preempted request
    out = driver.step()
    assert out.preempted_request_ids == ["b"] and [r.request_id for r in out.decode_rows] == ["a"]
    assert b.status == RequestStatus.PREEMPTED and list(scheduler.waiting) == [b, waiting]
    assert scheduler.num_preemptions == 1 and scheduler.num_preempted == 1 and scheduler.kv_planned_bytes == 31
    # b had 27 tokens dispatched, the last still in flight: it is read in this step, b resumes later.
    assert b.num_output_tokens == 27 and b.num_computed_tokens == 0
    # b and a as rows of 44 do not fit: b waits until a's last token is dispatched (step 40).
    for _ in range(29, 40):
        out = driver.step()
        assert out.new_requests == [] and [r.request_id for r in out.decode_rows] == ["a"]
    resumed = driver.step()
    new = resumed.new_requests[0]
    assert new.request_id == "b" and new.resumed and new.num_generated == 27
    assert new.prompt_token_ids == (0, 1, 2, 3, *range(1000, 1027))  # prompt + what it generated
    # a's row (43 tokens) is in the batch until this step ends: b's prefill takes what is left, 17 tokens.
    chunk = resumed.prefill_chunks[0]
    assert (chunk.request_id, chunk.start, chunk.num_tokens, chunk.completes_prefill) == ("b", 0, 17, False)
    assert scheduler.kv_planned_bytes == 60 and a.num_decode_steps == 40 and a.num_output_tokens == 39
    chunk = driver.step().prefill_chunks[0]
    assert a.status == RequestStatus.FINISHED_LENGTH and a.num_output_tokens == 40
    assert (chunk.request_id, chunk.start, chunk.num_tokens, chunk.completes_prefill) == ("b", 17, 14, True)
    assert b.status == RequestStatus.RUNNING and b.num_decode_steps == 28  # its completing chunk sampled token 28
    nxt = driver.step()
    assert [(r.request_id, r.sample_index) for r in nxt.decode_rows] == [("b", 28)]
    while scheduler.has_unfinished_requests():
        driver.step()
    assert b.output_token_ids == tuple(range(1000, 1040)) and waiting.num_output_tokens == 2
    assert scheduler.kv_peak_planned_bytes <= 60


def test_a_preempted_request_that_ends_while_waiting_is_freed_in_the_runner():
    scheduler = one_byte_a_token(60)
    driver = Driver(scheduler)
    driver.add("a", 4, 40)
    b = driver.add("b", 4, 40)
    while not scheduler.num_preemptions:
        driver.step()
    scheduler.finish_request(b, RequestStatus.FINISHED_ABORTED)
    assert b not in scheduler.waiting and scheduler.schedule().freed_request_ids == ["b"]


def test_queue_timeout_spares_preempted_requests():
    now = [0.0]
    scheduler = Scheduler(
        EngineConfig(prefill_chunk_tokens=0, queue_timeout=5.0), clock=lambda: now[0],
        kv_budget=KVBudget(60, 1, extra_positions=0),
    )
    driver = Driver(scheduler)
    driver.add("a", 4, 40)
    b = driver.add("b", 4, 40)
    while not scheduler.num_preemptions:
        driver.step()
    now[0] = 100.0
    assert driver.step().expired == [] and b.status == RequestStatus.PREEMPTED


def test_admission_waits_for_kv_and_a_chunked_prompt_reserves_its_kv_chunk_by_chunk():
    scheduler = Scheduler(EngineConfig(prefill_chunk_tokens=8), kv_budget=KVBudget(100, 1, extra_positions=0))
    driver = Driver(scheduler)
    for request_id, prompt_len in (("d", 10), ("long", 30), ("late", 30)):
        driver.add(request_id, prompt_len, 30 if request_id == "d" else 10)  # each ends at 40 tokens
    planned = []
    for _ in range(5):
        out = driver.step()
        planned.append((scheduler.kv_planned_bytes, [(c.request_id, c.num_tokens) for c in out.prefill_chunks]))
    # "long" is admitted beside d (each as a row of up to 40 tokens: 2 x 40 <= 100), "late" is not (3 x 40); the
    # plan counts each prefill's own cache chunk by chunk, then d's row, then both rows at the longer one's length.
    assert planned == [
        (8 + 8, [("d", 8), ("long", 8)]),
        (10 + 16, [("d", 2), ("long", 8)]),
        (11 + 24, [("long", 8)]),
        (12 + 30, [("long", 6)]),
        (2 * 31, []),
    ]
    assert [r.request_id for r in scheduler.running] == ["d", "long"] and scheduler.waiting[0].request_id == "late"


def test_a_request_that_fills_the_budget_alone_completes_with_speculation_on():
    """Its first decode row may verify only the drafts max_tokens leaves it: its prompt's last chunk fits."""
    spec = SpeculativeConfig(num_draft_tokens=4, adaptive=False)
    budget = KVBudget(12 + 4, 1, extra_positions=4)  # 12 tokens for one request
    budget.check_fits_alone(10, 2)
    scheduler = Scheduler(EngineConfig(prefill_chunk_tokens=0, speculative=spec), kv_budget=budget)
    driver = Driver(scheduler)
    request = driver.add("a", 10, 2)
    assert [(c.num_tokens, c.completes_prefill) for c in driver.step().prefill_chunks] == [(10, True)]
    assert [(r.request_id, r.max_draft_tokens) for r in driver.step().decode_rows] == [("a", 0)]
    driver.step()
    assert request.status == RequestStatus.FINISHED_LENGTH and scheduler.kv_peak_planned_bytes <= 16
