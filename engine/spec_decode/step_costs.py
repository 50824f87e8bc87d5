"""What verifying steps really cost here, measured: the draft policy's costs come from this device's own step
times, not from constants. A verifying step gives up the decode pipeline and computes more positions (and, with
a draft model, runs it); on MLX's CUDA backend a multi-position bf16 forward also builds an attention graph for
every new KV length (~50 ms on an H100), so the same drafts pay on one device and lose on another."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.spec_decode.adaptive import DraftCosts

PLAIN_DECAY = 0.9
VERIFY_DECAY = 0.8


@dataclass
class StepCosts:
    """Decayed means of plain decode step times per batch size, and of verifying steps' extra cost over them."""

    prior: DraftCosts = field(default_factory=DraftCosts)
    plain_s: dict[int, float] = field(default_factory=dict)
    # Measured fixed overhead of a verifying step, in plain steps (None until a verifying step was timed).
    sync_cost: float | None = None

    def observe_plain(self, num_rows: int, seconds: float) -> None:
        previous = self.plain_s.get(num_rows)
        self.plain_s[num_rows] = seconds if previous is None else PLAIN_DECAY * previous + (1 - PLAIN_DECAY) * seconds

    def observe_verify(self, num_rows: int, width: int, seconds: float) -> None:
        """A verifying step of `width` positions per row took `seconds`; compared with a plain step of as many rows."""
        plain = self._plain_near(num_rows)
        if plain is None:
            return
        overhead = max(0.0, seconds / plain - 1.0 - self.prior.token_cost * (width - 1))
        self.sync_cost = overhead if self.sync_cost is None else VERIFY_DECAY * self.sync_cost + (1 - VERIFY_DECAY) * overhead

    def calibrate(self, one_position_s: float, many_positions_s: float, width: int) -> None:
        """Seed the verify overhead from a load-time measurement: a forward of `width` positions against one of a
        single position, both at KV lengths the device had not seen, plus the pipeline a verifying step gives up."""
        extra = many_positions_s / one_position_s - 1.0 - self.prior.token_cost * (width - 1)
        self.sync_cost = self.prior.sync_cost + max(0.0, extra)

    def knows_plain(self, num_rows: int) -> bool:
        """Whether a plain step of about this many rows was timed (within a quarter, at least one row)."""
        return any(abs(n - num_rows) <= max(1, num_rows // 4) for n in self.plain_s)

    def _plain_near(self, num_rows: int) -> float | None:
        if not self.plain_s:
            return None
        nearest = min(self.plain_s, key=lambda n: abs(n - num_rows))
        return self.plain_s[nearest]

    def current(self) -> DraftCosts:
        if self.sync_cost is None:
            return self.prior
        return DraftCosts(sync_cost=self.sync_cost, token_cost=self.prior.token_cost)
