"""What verifying steps really cost here, measured: the draft policy's costs come from this device's own step
times, not from constants. A verifying step gives up the decode pipeline and computes more positions (and, with
a draft model, runs it), and what the extra positions cost grows with the batch (8 rows x 4 drafts of a 4B model
in fp32 cost an H100 about half a plain step more; one row's one draft, next to nothing): the same drafts pay on
one device and batch size and lose on another."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.spec_decode.adaptive import DraftCosts

PLAIN_DECAY = 0.9
VERIFY_DECAY = 0.9


@dataclass
class DecayedLineFit:
    """Decayed least squares of y = intercept + slope * x (older observations weigh less)."""

    decay: float
    weight: float = 0.0
    sum_x: float = 0.0
    sum_y: float = 0.0
    sum_xx: float = 0.0
    sum_xy: float = 0.0

    def add(self, x: float, y: float) -> None:
        d = self.decay
        self.weight, self.sum_x, self.sum_y = d * self.weight + 1, d * self.sum_x + x, d * self.sum_y + y
        self.sum_xx, self.sum_xy = d * self.sum_xx + x * x, d * self.sum_xy + x * y

    def solve(self, prior_slope: float) -> tuple[float, float]:
        """(intercept, slope), both at least 0; the prior slope while the x seen so far hardly differ."""
        mean_x, mean_y = self.sum_x / self.weight, self.sum_y / self.weight
        var_x = self.sum_xx / self.weight - mean_x * mean_x
        slope = (self.sum_xy / self.weight - mean_x * mean_y) / var_x if var_x > 0.25 else prior_slope
        slope = max(slope, 0.0)
        return max(mean_y - slope * mean_x, 0.0), slope


@dataclass(frozen=True)
class VerifyTiming:
    num_rows: int
    width: int
    seconds: float


@dataclass
class StepCosts:
    """Decayed means of plain decode step times per batch size, and a fit of what a verifying step costs beyond
    one: a fixed part (the pipeline it gives up) plus a part per extra position the whole batch computes, so a
    cost measured on one-draft probes of a lone row is not taken for that of four-draft steps of eight rows."""

    prior: DraftCosts = field(default_factory=DraftCosts)
    plain_s: dict[int, float] = field(default_factory=dict)
    # x: extra positions of a verifying forward (rows x drafts); y: its time beyond a plain step's, in plain steps.
    overhead: DecayedLineFit = field(default_factory=lambda: DecayedLineFit(VERIFY_DECAY))
    unsettled: "VerifyTiming | None" = None  # the last verifying step, until the step after it was timed

    def observe_plain(self, num_rows: int, seconds: float, pipelined: bool = True) -> None:
        """A plain step's wall time. The first after a verifying step (which read its own tokens back) has no step
        to overlap: the device idles while it builds its forward, and it returns no token (the next step reads it).
        That time is what verifying cost the pipeline, so it counts as the verifying step's."""
        if not pipelined:
            if self.unsettled is not None:
                self._fit(self.unsettled, seconds)
                self.unsettled = None
            return
        self._settle()
        previous = self.plain_s.get(num_rows)
        self.plain_s[num_rows] = seconds if previous is None else PLAIN_DECAY * previous + (1 - PLAIN_DECAY) * seconds

    def observe_verify(self, num_rows: int, width: int, seconds: float) -> None:
        """A verifying step of `width` positions per row took `seconds`; fitted once the next step shows whether
        restarting the pipeline cost more."""
        self._settle()
        self.unsettled = VerifyTiming(num_rows, width, seconds)

    def _settle(self) -> None:
        if self.unsettled is not None:
            self._fit(self.unsettled, 0.0)
            self.unsettled = None

    def _fit(self, step: VerifyTiming, extra_s: float) -> None:
        """Compared with a plain step of as many rows (none timed yet: nothing to compare with)."""
        plain = self._plain_near(step.num_rows)
        if plain is not None:
            self.overhead.add(step.num_rows * (step.width - 1), (step.seconds + extra_s) / plain - 1.0)

    def calibrate(self, one_position_s: float, many_positions_s: float, width: int) -> None:
        """Seed the fit from a load-time measurement: a forward of `width` positions against one of a single
        position (one row, KV lengths the device had not seen). What it costs beyond one is taken as fixed (shapes
        built per length), on top of the pipeline a verifying step gives up; the positions keep the prior's price.
        A measured difference below 0 is noise (on a tiny CPU model the two forwards take about as long)."""
        measured = max(many_positions_s / one_position_s - 1.0, 0.0)
        self.overhead.add(width - 1, measured + self.prior.sync_cost + self.prior.token_cost * (width - 1))

    @property
    def sync_cost(self) -> float | None:
        """The fitted fixed overhead of a verifying step, in plain steps (None until one was measured)."""
        return self.overhead.solve(self.prior.token_cost)[0] if self.overhead.weight else None

    def knows_plain(self, num_rows: int) -> bool:
        """Whether a plain step of about this many rows was timed (within a quarter, at least one row)."""
        return any(abs(n - num_rows) <= max(1, num_rows // 4) for n in self.plain_s)

    def _plain_near(self, num_rows: int) -> float | None:
        if not self.plain_s:
            return None
        nearest = min(self.plain_s, key=lambda n: abs(n - num_rows))
        return self.plain_s[nearest]

    def current(self, batch_rows: int = 1) -> DraftCosts:
        """Costs for a batch of `batch_rows`: every row computes the longest draft, so one more draft token costs
        the batch `batch_rows` positions."""
        if not self.overhead.weight:
            return DraftCosts(self.prior.sync_cost, self.prior.token_cost * batch_rows)
        sync, per_position = self.overhead.solve(self.prior.token_cost)
        return DraftCosts(sync_cost=sync, token_cost=per_position * batch_rows)
