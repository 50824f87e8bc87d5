"""The scheduler's KV-budget arithmetic over requests (plain Python, no MLX): the KV a step would hold, the longest
prompt chunk that fits it, the headroom admissions are weighed against, and who is preempted first. kv/budget.py
turns token counts into bytes; this module knows what a request will hold."""

from __future__ import annotations

from engine.kv.budget import ADMISSION_HEADROOM_TOKENS, AdmissionHeadroom, KVBudget, KVPlan
from engine.request import Request
from engine.spec_decode.config import SpeculativeConfig


def draft_allowance(spec: SpeculativeConfig | None, request: Request, decode_steps: int | None = None) -> int:
    """Drafts a row may verify this step: none past max_tokens (the scheduled token counts one); decode_steps: the
    row's count with this step's token (the KV plan asks before it is counted)."""
    if spec is None or not request.speculative or request.guide is not None:
        return 0
    steps = request.num_decode_steps if decode_steps is None else decode_steps
    return max(0, min(spec.num_draft_tokens, request.max_tokens - steps))


def step_plan(
    budget: KVBudget, decoding: dict[str, Request], prefilling: list[Request], spec: SpeculativeConfig | None
) -> KVPlan:
    """This step's KV before any prefill chunk: decode rows after their token (and drafts), prefills so far."""
    plan = KVPlan(budget)
    for request_id, request in decoding.items():
        plan.rows[request_id] = request.num_computed_tokens + draft_allowance(spec, request)
    for request in prefilling:
        plan.prefills[request.request_id] = request.num_computed_tokens
    return plan


def growth_lengths(
    decodable: list[Request], prefilling: list[Request], spec: SpeculativeConfig | None
) -> tuple[list[int], list[int]]:
    """The KV lengths the running requests would hold after this step if all decode rows ran and no prefill did:
    (decode rows', prefills'), in the order given."""
    rows = [r.num_computed_tokens + 1 + draft_allowance(spec, r, r.num_decode_steps + 1) for r in decodable]
    return rows, [r.num_computed_tokens for r in prefilling]


def chunk_that_fits(request: Request, start: int, size: int, plan: KVPlan, spec: SpeculativeConfig | None) -> int:
    """The longest chunk of at most `size` tokens from `start` whose KV fits the plan; a completing chunk must also
    fit as a decode row next step (else it would be preempted as soon as it joined)."""
    sizing = plan.sizing(request.request_id)
    low, high = 0, size
    while low < high:  # bytes grow with the chunk: the longest that fits
        mid = (low + high + 1) // 2
        if sizing.fits_with(start + mid, as_row=False):
            low = mid
        else:
            high = mid - 1
    if start + low == request.num_prefill_tokens:  # its first decode step: sample 2 (after a resumption, more)
        drafts = draft_allowance(spec, request, request.num_recomputed_outputs + 2)
        if not sizing.fits_with(start + low + 1 + drafts, as_row=True):
            low -= 1
    return max(0, low)


def admission_headroom(budget: KVBudget, running: list[Request]) -> AdmissionHeadroom:
    """The running requests that will still hold KV, as may_admit weighs them."""
    headroom = AdmissionHeadroom(budget)
    for request in running:
        count_headroom(headroom, request)
    return headroom


def count_headroom(headroom: AdmissionHeadroom, request: Request) -> None:
    if request.is_prefilling or request.wants_more_decode_steps:
        headroom.add(headroom_length(request, max(request.num_computed_tokens, request.num_prefill_tokens)))


def may_admit(request: Request, headroom: AdmissionHeadroom | None) -> bool:
    """Whether the admitted requests and this one could all run ADMISSION_HEADROOM_TOKENS more tokens in one batch
    (each capped at its final length). A lone request always may (it fits alone: checked at submit)."""
    return headroom is None or headroom.admits(headroom_length(request, request.num_prefill_tokens))


def headroom_length(request: Request, length: int) -> int:
    return min(length + ADMISSION_HEADROOM_TOKENS, request.num_prompt_tokens + request.max_tokens)


def newest_of_lowest_class(requests: list[Request]) -> Request:
    """The last admitted of the lowest-priority class present (requests in admission order)."""
    lowest = max(r.priority for r in requests)
    return next(r for r in reversed(requests) if r.priority == lowest)


__all__ = [
    "admission_headroom", "chunk_that_fits", "count_headroom", "draft_allowance", "growth_lengths", "may_admit",
    "newest_of_lowest_class", "step_plan",
]
