"""Per-row speculation state the runner keeps (plain Python): each row's known text, n-gram index and draft
policy, the step's draft lengths, and the model's acceptance counts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from engine.spec_decode.adaptive import AcceptanceHistory, DraftCosts, RowDraftPolicy, expected_tokens, fit_lengths
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.ngram import NgramIndex
from engine.spec_decode.step_costs import StepCosts


@dataclass
class SpeculationStats:
    """Counts since the engine started: steps that verified drafts, drafted and accepted tokens."""

    method: str
    verify_steps: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    # A verifying step's fixed cost in plain decode steps (what the draft policy weighs): calibrated at load (engine
    # clients warm up), then measured; None before either. Filled from StepCosts when the stats are read.
    verify_overhead: float | None = None

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else None


@dataclass
class SpecRow:
    tokens: list[int]  # the prompt and every token read back so far
    policy: RowDraftPolicy
    index: NgramIndex | None = None


@dataclass
class Speculator:
    config: SpeculativeConfig
    max_verify_tokens: int
    costs: StepCosts = field(default_factory=StepCosts)
    rows: dict[str, SpecRow] = field(default_factory=dict)
    history: AcceptanceHistory = field(default_factory=AcceptanceHistory)  # where a new row's acceptance starts
    # Where host drafts come from: prompt lookup, unless replaced by a drafter of known agreement (bench/
    # speculative.py measures speed against acceptance with one): (request id, known text, length) -> drafts.
    host_drafter: Callable[[str, list[int], int], list[int]] | None = None

    def __post_init__(self) -> None:
        self.stats = SpeculationStats(self.config.method)

    @property
    def uses_ngram(self) -> bool:
        return self.config.method == "ngram"

    def add(self, request_id: str, prompt_token_ids: tuple[int, ...]) -> None:
        policy = self.history.new_row_policy(self.config.num_draft_tokens)
        row = SpecRow(list(prompt_token_ids), policy)
        if self.uses_ngram:
            row.index = NgramIndex(self.config.min_match, self.config.max_match)
            row.index.extend(prompt_token_ids)
            row.tokens = row.index.tokens  # one list, shared
        self.rows[request_id] = row

    def forget(self, request_id: str) -> None:
        self.rows.pop(request_id, None)

    def record_tokens(self, request_id: str, token_ids: list[int]) -> None:
        row = self.rows.get(request_id)
        if row is None:
            return
        if row.index is not None:
            row.index.extend(token_ids)
        else:
            row.tokens.extend(token_ids)

    def plan(self, allowances: dict[str, int], batch_size: int) -> dict[str, int]:
        """Each decode row's draft length this step (rows not tracked draft none); all 0: decode plainly.
        An adaptive batch of a size whose plain steps were never timed decodes plainly first: without that time
        a verifying step's cost cannot be told."""
        if self.config.adaptive and not self.costs.knows_plain(batch_size):
            return {request_id: 0 for request_id in allowances}
        lengths = {}
        costs = self.costs.current(batch_size)
        for request_id, allowance in allowances.items():
            row = self.rows.get(request_id)
            if row is None or allowance <= 0:
                lengths[request_id] = 0
            elif self.host_drafter is None and row.index is not None and row.index.match_end() is None:
                lengths[request_id] = 0  # nothing to look up (the text known so far has no earlier match)
            elif not self.config.adaptive:
                lengths[request_id] = min(allowance, self.config.num_draft_tokens)
            else:
                lengths[request_id] = row.policy.length(allowance, costs, batch_size)
        self._probes_together(lengths, allowances, costs, batch_size)
        fitted = dict(zip(lengths, fit_lengths(list(lengths.values()), batch_size, self.max_verify_tokens)))
        if self.config.adaptive and not self._batch_gains(fitted, batch_size, costs):
            return {request_id: 0 for request_id in fitted}
        return fitted

    def _probes_together(self, lengths: dict[str, int], allowances: dict[str, int], costs: DraftCosts, batch_size: int) -> None:
        """When one row probes, every idle row that may draft probes in the same step (one verifying step for the
        batch instead of one per row)."""
        if not self.config.adaptive or not any(n and self.rows[rid].policy.is_probing for rid, n in lengths.items()):
            return
        for request_id, length in lengths.items():
            row = self.rows.get(request_id)
            if length == 0 and row is not None and allowances[request_id] > 0 and (
                row.index is None or self.host_drafter is not None or row.index.match_end() is not None
            ):
                lengths[request_id] = row.policy.ride_along(costs, batch_size)

    def _batch_gains(self, lengths: dict[str, int], batch_size: int, costs: DraftCosts) -> bool:
        """Whether verifying pays for the whole batch: every row computes the longest draft's positions and the
        pipeline waits for all, so the rows' expected tokens together must beat that cost (a probe always may)."""
        drafting = {rid: n for rid, n in lengths.items() if n > 0}
        if any(self.rows[rid].policy.is_probing for rid in drafting):
            return True
        expected = batch_size - len(drafting) + sum(
            expected_tokens(self.rows[rid].policy.acceptance, n) for rid, n in drafting.items()
        )
        cost = 1.0 + costs.sync_cost + costs.token_cost * max(drafting.values(), default=0)
        return bool(drafting) and expected > batch_size * cost

    def ngram_drafts(self, lengths: dict[str, int]) -> dict[str, list[int]]:
        if self.host_drafter is not None:
            return {rid: self.host_drafter(rid, self.rows[rid].tokens, n) for rid, n in lengths.items() if n > 0}
        return {rid: self.rows[rid].index.propose(n) for rid, n in lengths.items() if n > 0}

    def histories(self, request_ids) -> dict[str, list[int]]:
        return {rid: self.rows[rid].tokens for rid in request_ids}

    def record_verification(self, request_id: str, drafted: int, accepted: int) -> None:
        row = self.rows.get(request_id)
        if row is not None:
            row.policy.record(drafted, accepted)
        self.history.record(drafted, accepted)
        if drafted:
            self.stats.drafted_tokens += drafted
            self.stats.accepted_tokens += accepted
