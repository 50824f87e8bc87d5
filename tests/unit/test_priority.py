"""Priority classes in the scheduler (no MLX): interactive requests are queued and prefilled ahead of batch ones, take
a batch row's decode slot when none is free, and a KV preemption takes batch rows first; a preempted batch row
resumes with what it generated (the driver plays the core: tests/unit/test_kv_budget.py)."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.request import Priority, Request, RequestStatus
from engine.sampling.params import SamplingParams
from engine.scheduler import Scheduler
from tests.unit.test_kv_budget import Driver, one_byte_a_token


def add(driver: Driver, request_id: str, prompt_len: int, max_tokens: int, priority: Priority) -> Request:
    request = Request(request_id, list(range(prompt_len)), SamplingParams(max_tokens=max_tokens), priority=priority)
    driver.requests[request_id] = request
    driver.scheduler.add_request(request)
    return request


def test_interactive_requests_are_queued_ahead_of_batch_ones_first_come_within_a_class():
    driver = Driver(Scheduler(EngineConfig(max_decode_seqs=2, prefill_chunk_tokens=0)))
    for rid in ("b1", "b2", "b3"):
        add(driver, rid, 3, 2, Priority.BATCH)
    add(driver, "i1", 3, 2, Priority.INTERACTIVE)
    add(driver, "i2", 3, 2, Priority.INTERACTIVE)
    assert [r.request_id for r in driver.scheduler.waiting] == ["i1", "i2", "b1", "b2", "b3"]
    out = driver.step()
    assert [n.request_id for n in out.new_requests] == ["i1", "i2"]
    assert [c.request_id for c in out.prefill_chunks] == ["i1", "i2"] and out.preempted_request_ids == []


def test_an_interactive_request_takes_the_newest_batch_rows_slot_which_resumes_after_it():
    scheduler = Scheduler(EngineConfig(max_decode_seqs=2, prefill_chunk_tokens=0))
    driver = Driver(scheduler)
    b1, b2 = add(driver, "b1", 3, 12, Priority.BATCH), add(driver, "b2", 3, 12, Priority.BATCH)
    for _ in range(4):
        assert driver.step().preempted_request_ids == []
    interactive = add(driver, "i", 5, 3, Priority.INTERACTIVE)
    out = driver.step()
    assert out.preempted_request_ids == ["b2"] and b2.status == RequestStatus.PREEMPTED
    assert [n.request_id for n in out.new_requests] == ["i"] and [c.num_tokens for c in out.prefill_chunks] == [5]
    assert [r.request_id for r in out.decode_rows] == ["b1"] and list(scheduler.waiting) == [b2]
    steps = 0
    while scheduler.has_unfinished_requests():
        out = driver.step()
        steps += 1
        if any(n.request_id == "b2" for n in out.new_requests):
            assert interactive.is_finished  # the slot came back when the interactive request ended
            resumed = next(n for n in out.new_requests if n.request_id == "b2")
            assert resumed.resumed and resumed.num_generated == 4  # its 4 tokens before; the 5th just sampled
    assert steps < 30 and scheduler.num_preemptions == 1
    # Every request got its tokens in order: b2's resumption continued where it stopped.
    for request in (b1, b2, interactive):
        assert request.output_token_ids == tuple(range(1000, 1000 + request.max_tokens))


def test_a_kv_preemption_takes_a_batch_row_before_a_newer_interactive_one():
    scheduler = one_byte_a_token(60)
    driver = Driver(scheduler)
    batch = add(driver, "batch", 4, 40, Priority.BATCH)
    driver.step()
    interactive = add(driver, "i", 4, 40, Priority.INTERACTIVE)
    while not scheduler.num_preemptions:
        out = driver.step()
    # Under one class the newest (i) would go: here the batch row goes though it was admitted first.
    assert out.preempted_request_ids == ["batch"] and batch.status == RequestStatus.PREEMPTED
    assert interactive.status == RequestStatus.RUNNING
    while scheduler.has_unfinished_requests():
        driver.step()
    assert batch.output_token_ids == tuple(range(1000, 1040)) == interactive.output_token_ids
