"""Drive an EngineCore step by step, with requests arriving or aborted at chosen steps."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core import EngineCore
from engine.output.request_output import Finish
from engine.request import Request


@dataclass
class Collected:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    finish: Finish | None = None


@dataclass
class Arrival:
    step: int
    request: Request


def collect(outputs, results: dict[str, Collected]) -> None:
    """A step's outputs added to each request's collected stream."""
    for output in outputs:
        collected = results.setdefault(output.request_id, Collected())
        if output.delta is not None:
            collected.token_ids += output.delta.token_ids
            collected.text += output.delta.text
            collected.logprobs += [lp.logprob for lp in output.delta.logprobs or []]
        collected.finish = output.finish or collected.finish


def run_core(
    core: EngineCore,
    arrivals: list[Arrival],
    aborts: dict[int, list[str]] | None = None,
    max_steps: int = 10_000,
) -> dict[str, Collected]:
    results: dict[str, Collected] = {}
    pending = sorted(arrivals, key=lambda a: a.step)
    aborts = aborts or {}
    step = 0
    while pending or core.has_unfinished_requests():
        while pending and pending[0].step <= step:
            core.add_request(core.limits.validate(pending.pop(0).request))
        for request_id in aborts.get(step, []):
            output = core.abort_request(request_id)
            if output is not None:
                results[request_id].finish = output.finish
        collect(core.step(), results)
        step += 1
        assert step < max_steps, "engine did not finish"
    return results
