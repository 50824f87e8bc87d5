"""bench.engine_throughput --step-trace: a run's steps recovered from its emissions (one timestamp per step)."""

from bench.engine_throughput import Trace, step_trace


def test_each_step_is_its_tokens_and_the_milliseconds_since_the_step_before():
    trace = Trace(start=10.0)
    for request_id in ("a", "b", "c"):  # a step of three rows
        trace.add(request_id, 1, 10.5)
    trace.add("a", 1, 10.508)  # two rows left: a step of one row, 8 ms later
    trace.add("b", 0, 10.6)  # no tokens: not a step
    trace.add("a", 3, 10.62)  # a verify step's accepted drafts count as its tokens
    assert step_trace(trace) == [[500.0, 3], [8.0, 1], [112.0, 3]]
