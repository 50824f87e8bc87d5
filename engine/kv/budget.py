"""The KV budget in plain Python: what the running requests' KV occupies, and whether a request may fit.

Counted as allocated, not as logical tokens. mlx-lm's KVCache and BatchKVCache grow their buffers 256 positions
at a time, and a decode batch keeps its rows right-aligned at one shared index: a batch of R rows whose longest
row holds L tokens allocates R x (L + at most 256) positions, padding included, whatever the other rows hold. A
logical count with a margin would be wrong by up to 256 x R positions (most of the KV on a short-context batch);
this bound is what the buffers really take (checked against the runner's arrays in tests/engine/test_kv_budget.py).
Copies made while rows join or leave (one layer at a time) are not counted: kv_memory_fraction leaves room for them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from engine.errors import KVBudgetExceededError

# mlx-lm's KVCache.step / BatchKVCache.step: positions a cache buffer grows by.
KV_ALLOCATION_STEP = 256
# A request is admitted only if every admitted request could then compute this many more tokens together: fewer
# admissions that are preempted again a few steps later (each preemption recomputes the request's KV).
ADMISSION_HEADROOM_TOKENS = 16


@dataclass(frozen=True)
class KVBudget:
    """budget_bytes: what the running requests' KV may occupy; bytes_per_token: one position of every layer
    (kv_layout.py); extra_positions: unused buffer room a cache may hold beyond its tokens (the
    allocation step, plus the drafts a verify step writes and then drops)."""

    budget_bytes: int
    bytes_per_token: int
    extra_positions: int = KV_ALLOCATION_STEP

    @property
    def max_request_tokens(self) -> int:
        """The most tokens (prompt + generated + drafts) one request alone may hold."""
        return max(0, self.budget_bytes // self.bytes_per_token - self.extra_positions)

    def bytes_of(self, row_lengths: Iterable[int], prefill_lengths: Iterable[int]) -> int:
        """Bytes allocated for decode rows of these KV lengths (one right-aligned batch) and prefilling requests'
        own caches of these lengths."""
        rows = list(row_lengths)
        return self.batch_bytes(len(rows), max(rows, default=0)) + self.prefill_bytes(prefill_lengths)

    def batch_bytes(self, num_rows: int, longest_row: int) -> int:
        """One right-aligned batch: every row is as wide as the longest."""
        return num_rows * (longest_row + self.extra_positions) * self.bytes_per_token if num_rows else 0

    def prefill_bytes(self, lengths: Iterable[int]) -> int:
        return sum(n + self.extra_positions for n in lengths if n > 0) * self.bytes_per_token

    def check_fits_alone(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise KVBudgetExceededError (400) for a request whose KV could never fit, even running alone."""
        needed = num_prompt_tokens + max_tokens
        if needed <= self.max_request_tokens:
            return
        raise KVBudgetExceededError(
            f"The request needs KV for {needed} tokens ({num_prompt_tokens} in the prompt + {max_tokens} to "
            f"generate) at {self.bytes_per_token} bytes per token, {self.bytes_of([needed], [])} bytes with the "
            f"cache's allocation step, but this model's KV budget is {self.budget_bytes} bytes (at most "
            f"{self.max_request_tokens} tokens for one request)",
            param="max_tokens" if num_prompt_tokens < self.max_request_tokens else "messages",
        )


@dataclass
class KVPlan:
    """The KV each admitted request holds at the end of the step being scheduled: decode rows (one batch) and
    prefilling requests (their own caches), by request id."""

    budget: KVBudget
    rows: dict[str, int] = field(default_factory=dict)
    prefills: dict[str, int] = field(default_factory=dict)

    @property
    def bytes(self) -> int:
        return self.budget.bytes_of(self.rows.values(), self.prefills.values())

    def fits(self) -> bool:
        return self.bytes <= self.budget.budget_bytes

    def sizing(self, request_id: str) -> "PlanSizing":
        """The plan's totals without this request: each length a chunk search tries is then one sum, not a pass
        over every request (a burst of 128 prompts took 24 ms to schedule on a 2-core CPU)."""
        rows = [n for rid, n in self.rows.items() if rid != request_id]
        prefills = (n for rid, n in self.prefills.items() if rid != request_id)
        return PlanSizing(self.budget, len(rows), max(rows, default=0), self.budget.prefill_bytes(prefills))

    def drop(self, request_id: str) -> None:
        self.rows.pop(request_id, None)
        self.prefills.pop(request_id, None)


@dataclass(frozen=True)
class PlanSizing:
    """A KVPlan's decode rows (their count and longest) and prefills (their bytes), one request left out."""

    budget: KVBudget
    num_rows: int
    longest_row: int
    prefill_bytes: int

    def fits_with(self, length: int, as_row: bool) -> bool:
        """Whether the plan fits with the left-out request holding `length` tokens (as a decode row or a prefill)."""
        if as_row:
            total = self.budget.batch_bytes(self.num_rows + 1, max(self.longest_row, length)) + self.prefill_bytes
        else:
            total = (self.budget.batch_bytes(self.num_rows, self.longest_row) + self.prefill_bytes
                     + self.budget.prefill_bytes((length,)))
        return total <= self.budget.budget_bytes


@dataclass
class AdmissionHeadroom:
    """The admitted requests as one batch each ADMISSION_HEADROOM_TOKENS on (capped at its final length): their count
    and the longest, kept up to date as a step admits requests instead of recounted for each."""

    budget: KVBudget
    num_rows: int = 0
    longest: int = 0

    def admits(self, length: int) -> bool:
        """Whether one more request of this headroom length fits beside them (a lone request always does: checked at
        submit)."""
        if not self.num_rows:
            return True
        return self.budget.batch_bytes(self.num_rows + 1, max(self.longest, length)) <= self.budget.budget_bytes

    def add(self, length: int) -> None:
        self.num_rows += 1
        self.longest = max(self.longest, length)
