"""Per-row LoRA: every batch row of a forward may use a different adapter, in the same step.

Each target linear layer is wrapped once (MultiLoraLinear) around its unchanged base; beside it lie stacks of every
loaded adapter's A [slots, in, R] and B [slots, R, out] (float32, ranks zero-padded to R, slot 0 all zeros: no
adapter) and scales [slots]. A forward's rows name their slots (AdapterBank.applying, around the model call: mlx-lm's
models take no per-call arguments down to their layers):
- no row has an adapter: the wrapped layer is its base alone, nothing more is computed;
- all rows share one: (x A_k) B_k, two small matmuls;
- mixed: two gathered matmuls (mx.gather_mm: row i against its own slot's A, then B), the batch stays one forward.
The update is LoRALinear's: scale · (x A) B in float32, cast to x's dtype and added. The stacks live outside the
module tree (plain attributes), so the model's parameters, dtype casts and memory reports do not see them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from engine.adapters.weights import AdapterWeights, linear_dims


@dataclass(frozen=True)
class RowAdapters:
    """The adapter slots of one forward's rows: all one slot (`uniform`), or per row (`slots`, [rows] uint32)."""

    uniform: int | None
    slots: mx.array | None
    used: frozenset[int]


class ModuleStacks:
    """One wrapped layer's adapters, by slot (a plain object: nn.Module would take arrays for parameters)."""

    def __init__(self, in_dims: int, out_dims: int, num_slots: int, rank: int) -> None:
        self.a = mx.zeros((num_slots, in_dims, rank), mx.float32)
        self.b = mx.zeros((num_slots, rank, out_dims), mx.float32)
        self.scales = mx.zeros((num_slots,), mx.float32)
        self.targeted: set[int] = set()  # slots whose adapter updates this layer

    def resize(self, num_slots: int, rank: int) -> None:
        """Grow to `num_slots` slots and rank `rank`, zero-filled (slots and ranks never shrink)."""
        slots, in_dims, old_rank = self.a.shape
        out_dims = self.b.shape[2]
        if rank > old_rank:
            self.a = mx.concatenate([self.a, mx.zeros((slots, in_dims, rank - old_rank), mx.float32)], axis=2)
            self.b = mx.concatenate([self.b, mx.zeros((slots, rank - old_rank, out_dims), mx.float32)], axis=1)
        if num_slots > slots:
            more = num_slots - slots
            self.a = mx.concatenate([self.a, mx.zeros((more, in_dims, self.a.shape[2]), mx.float32)])
            self.b = mx.concatenate([self.b, mx.zeros((more, self.b.shape[1], out_dims), mx.float32)])
            self.scales = mx.concatenate([self.scales, mx.zeros((more,), mx.float32)])

    def write(self, slot: int, a: mx.array | None, b: mx.array | None, scale: float) -> None:
        rank = self.a.shape[2]
        if a is None or b is None:
            self.a[slot] = mx.zeros(self.a.shape[1:], mx.float32)
            self.b[slot] = mx.zeros(self.b.shape[1:], mx.float32)
            self.scales[slot] = 0.0
            self.targeted.discard(slot)
            return
        self.a[slot] = mx.pad(a, [(0, 0), (0, rank - a.shape[1])])
        self.b[slot] = mx.pad(b, [(0, rank - b.shape[0]), (0, 0)])
        self.scales[slot] = scale
        self.targeted.add(slot)

    def arrays(self) -> list[mx.array]:
        return [self.a, self.b, self.scales]


class MultiLoraLinear(nn.Module):
    """A linear layer plus the adapter update of each row's slot (see the module's docstring)."""

    def __init__(self, base: nn.Module, stacks: ModuleStacks, bank: "AdapterBank") -> None:
        super().__init__()
        self.base = base
        self._stacks = stacks
        self._bank = bank

    def __call__(self, x: mx.array) -> mx.array:
        y = self.base(x)
        rows, stacks = self._bank.rows, self._stacks
        if rows is None or not (stacks.targeted & rows.used):
            return y
        wide = x.astype(mx.float32)
        if rows.uniform is not None:
            k = rows.uniform
            z = ((wide @ stacks.a[k]) @ stacks.b[k]) * stacks.scales[k]
        else:
            z = mx.gather_mm(mx.gather_mm(wide, stacks.a, rhs_indices=rows.slots), stacks.b, rhs_indices=rows.slots)
            z = z * stacks.scales[rows.slots].reshape(-1, *([1] * (z.ndim - 1)))
        return y + z.astype(x.dtype)


@dataclass
class AdapterBank:
    """The model's per-row adapters: its wrapped layers' stacks, and the rows of the forward being built."""

    model: nn.Module
    num_slots: int = 1  # slot 0: no adapter
    rank: int = 1
    rows: RowAdapters | None = None
    _stacks: dict[str, ModuleStacks] = field(default_factory=dict)
    _last_rows: tuple[tuple[int, ...], RowAdapters | None] | None = None

    def write(self, slot: int, weights: AdapterWeights) -> None:
        """Put an adapter in `slot` (>= 1), replacing what was there; layers it targets are wrapped on first use."""
        self.num_slots, self.rank = max(self.num_slots, slot + 1), max(self.rank, weights.rank)
        self._wrap(path for path in weights.deltas if path not in self._stacks)
        for path, stacks in self._stacks.items():
            stacks.resize(self.num_slots, self.rank)
            delta = weights.deltas.get(path)
            stacks.write(slot, delta.a if delta else None, delta.b if delta else None, delta.scale if delta else 0.0)
        self._evaluate()

    def clear(self, slot: int) -> None:
        """Zero `slot` (its adapter unloaded): rows naming it would get the base model."""
        for stacks in self._stacks.values():
            if slot < stacks.a.shape[0]:
                stacks.write(slot, None, None, 0.0)
        self._evaluate()

    @property
    def nbytes(self) -> int:
        return sum(array.nbytes for stacks in self._stacks.values() for array in stacks.arrays())

    @contextlib.contextmanager
    def applying(self, slots: Sequence[int]) -> Iterator[None]:
        """Forwards built inside use these slots, one per batch row (padding rows: 0)."""
        self.rows = self._rows_of(tuple(slots))
        try:
            yield
        finally:
            self.rows = None

    def _rows_of(self, slots: tuple[int, ...]) -> RowAdapters | None:
        if self._last_rows is not None and self._last_rows[0] == slots:  # decode: the same rows step after step
            return self._last_rows[1]
        used = frozenset(slots) - {0}
        if not used:
            rows = None
        elif len(set(slots)) == 1:
            rows = RowAdapters(slots[0], None, used)
        else:
            rows = RowAdapters(None, mx.array(slots, mx.uint32), used)
        self._last_rows = (slots, rows)
        return rows

    def _wrap(self, paths) -> None:
        modules = dict(self.model.named_modules())
        wrapped = []
        for path in paths:
            in_dims, out_dims = linear_dims(modules[path])
            stacks = self._stacks[path] = ModuleStacks(in_dims, out_dims, self.num_slots, self.rank)
            wrapped.append((path, MultiLoraLinear(modules[path], stacks, self)))
        if wrapped:
            self.model.update_modules(tree_unflatten(wrapped))

    def _evaluate(self) -> None:
        mx.eval([array for stacks in self._stacks.values() for array in stacks.arrays()])


__all__ = ["AdapterBank", "MultiLoraLinear", "RowAdapters"]
