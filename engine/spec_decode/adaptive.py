"""How many tokens each row drafts: the length that maximises expected tokens per unit of step cost, from the
row's measured acceptance; 0 (plain, pipelined decode) when drafting does not pay.

Acceptance is modelled per draft token (a row accepts each next draft with probability alpha), estimated from
decayed counts of accepted drafts and rejections. A step that verifies k drafts yields (1 - alpha^(k+1)) /
(1 - alpha) tokens on average and costs 1 + sync_cost + k * token_cost plain steps: sync_cost is the decode
pipeline a verifying step gives up (its drafts need the previous token on the host), token_cost what one more
verified position (and, for a draft model, one more draft forward) adds. A row that stopped drafting probes
again after a back-off (doubling while probes keep failing), so a text that turns repetitive is found; a probe
makes the whole batch verify, so the wait also grows with the batch and with what a verifying step costs.
A new row starts from the acceptance the model's recent rows met (AcceptanceHistory), once there is one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DECAY = 0.9
PRIOR_ACCEPTED, PRIOR_REJECTED = 2.0, 1.0
FIRST_PROBE_AFTER, MAX_PROBE_AFTER = 8, 256
# The model's acceptance over its rows' recent verifications (~50), and how many (decayed: about four) it takes
# before a new row starts from it rather than from the fixed prior.
HISTORY_DECAY, HISTORY_TRUSTED_AFTER = 0.98, 3.5


@dataclass(frozen=True)
class DraftCosts:
    """Costs in units of one plain decode step of the batch: token_cost is what one more draft token per row adds."""

    sync_cost: float = 0.1
    token_cost: float = 0.03


@dataclass
class RowDraftPolicy:
    max_length: int
    accepted: float = PRIOR_ACCEPTED
    rejected: float = PRIOR_REJECTED
    # Plain steps left before an idle row probes again, and the back-off to use after a failed probe.
    steps_to_probe: int = 0
    probe_after: int = FIRST_PROBE_AFTER
    # What the last probe cost the batch, in plain steps of this row's own (rows x (1 + sync cost)).
    probe_cost: float = 1.0
    # The length just given is a probe (drafting does not pay by the estimate; the estimate is being checked).
    is_probing: bool = False
    # Drafting paid by the estimate when the row last asked: a row whose estimate turns against drafting waits a
    # back-off before its first probe, as after a failed probe. A new row counts as paying when its prior is the
    # model's measured history (which says no for a reason); on the fixed prior it probes at once (nothing else
    # would ever measure what verifying costs, nor this row's acceptance).
    paying: bool = False

    @property
    def acceptance(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def length(self, allowance: int, costs: DraftCosts, batch_rows: int = 1) -> int:
        """Drafts for this step (0: decode plainly), at most `allowance`; batch_rows: the decode batch's size."""
        limit = min(self.max_length, allowance)
        self.is_probing = False
        if limit <= 0:
            return 0
        best = best_length(self.acceptance, limit, costs)
        if best > 0:
            self.paying = True
            return best
        if best_length(1.0, limit, costs) == 0:  # not even drafts that are always taken would pay: wait longest
            self.probe_after = MAX_PROBE_AFTER
        if self.paying:
            self.paying = False
            self._back_off(probe_cost(costs, batch_rows))
        if self.steps_to_probe > 0:
            self.steps_to_probe -= 1
            return 0
        self.probe_cost = probe_cost(costs, batch_rows)
        self.is_probing = True
        return 1  # a probe: one draft, so that the estimate can recover

    def ride_along(self, costs: DraftCosts, batch_rows: int) -> int:
        """Another row probes, so the batch verifies anyway: one draft of this row's costs next to nothing."""
        self.steps_to_probe, self.is_probing = 0, True
        self.probe_cost = probe_cost(costs, batch_rows)
        return 1

    def record(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        self.accepted = DECAY * self.accepted + accepted
        self.rejected = DECAY * self.rejected + (1 if accepted < drafted else 0)
        if accepted == 0 and self.is_probing:  # a failed probe: the next one waits twice as long
            self._back_off(self.probe_cost)
        elif accepted == drafted:  # every draft taken: the text may have turned predictable, look again soon
            self.probe_after = FIRST_PROBE_AFTER

    def _back_off(self, probe_cost: float) -> None:
        """Plain steps before the next probe: the back-off times what a probe costs the batch; then it doubles.
        Only probes (and a row turning against drafting) back off: a drafting row whose drafts all miss once
        just drafts less while its acceptance says so."""
        self.steps_to_probe = math.ceil(self.probe_after * max(probe_cost, 1.0))
        self.probe_after = min(self.probe_after * 2, MAX_PROBE_AFTER)


@dataclass
class AcceptanceHistory:
    """Decayed counts over every row's verifications, in a row policy's units (accepted drafts, rejections): a
    workload that never accepts (a draft model that disagrees) starts its next requests off instead of paying
    full-length drafts until each request has learnt it; one that accepts well starts them drafting."""

    accepted: float = 0.0
    rejected: float = 0.0
    verifications: float = 0.0

    def record(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        self.accepted = HISTORY_DECAY * self.accepted + accepted
        self.rejected = HISTORY_DECAY * self.rejected + (1 if accepted < drafted else 0)
        self.verifications = HISTORY_DECAY * self.verifications + 1

    @property
    def trusted(self) -> bool:
        return self.verifications >= HISTORY_TRUSTED_AFTER

    def new_row_policy(self, max_length: int) -> RowDraftPolicy:
        """A new row's policy: the fixed prior's weight at the model's recent acceptance, once that is known."""
        accepted, rejected = self.prior()
        return RowDraftPolicy(max_length, accepted, rejected, paying=self.trusted)

    def prior(self) -> tuple[float, float]:
        """A new row's (accepted, rejected) counts."""
        if not self.trusted:
            return PRIOR_ACCEPTED, PRIOR_REJECTED
        share = self.accepted / (self.accepted + self.rejected)
        weight = PRIOR_ACCEPTED + PRIOR_REJECTED
        return weight * share, weight * (1.0 - share)


def probe_cost(costs: DraftCosts, batch_rows: int) -> float:
    """What one probe costs the batch in plain steps of a row's own: every row verifies (rows x (1 + sync cost))."""
    return batch_rows * (1.0 + costs.sync_cost)


def expected_tokens(alpha: float, length: int) -> float:
    if alpha >= 1.0:
        return float(length + 1)
    return (1.0 - alpha ** (length + 1)) / (1.0 - alpha)


def best_length(alpha: float, limit: int, costs: DraftCosts) -> int:
    """The draft length in 0..limit with the most expected tokens per unit of cost (0 costs exactly 1)."""
    best, best_rate = 0, 1.0
    for length in range(1, limit + 1):
        rate = expected_tokens(alpha, length) / (1.0 + costs.sync_cost + length * costs.token_cost)
        if rate > best_rate * 1.02:  # a clear gain only: a coin-flip gain costs latency variance
            best, best_rate = length, rate
    return best


def default_max_verify_tokens(device_is_gpu: bool) -> int:
    """Positions one verifying forward may compute before decode turns compute-bound: a GPU's decode step costs
    about the same for tens of positions; a CPU's matmuls already scale with a few."""
    return 64 if device_is_gpu else 16


def fit_lengths(lengths: list[int], num_rows: int, max_verify_tokens: int) -> list[int]:
    """Every row of the batch computes 1 + max(lengths) positions: cap the lengths so that the batch's verifying
    forward stays within max_verify_tokens (all 0 when even one draft per row does not fit)."""
    cap = max_verify_tokens // max(num_rows, 1) - 1
    return [min(length, max(cap, 0)) for length in lengths]
