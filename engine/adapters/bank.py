"""Per-row LoRA: every batch row of a forward may use a different adapter, in the same step.

Each target linear layer is wrapped once (MultiLoraLinear) around its unchanged base; beside it lie every loaded
adapter's A [in, slots, R] and scale·B [slots, R, out] (ranks zero-padded to R, slot 0 all zeros: no adapter), in the
model's dtype. A forward's rows name their slots (AdapterBank.applying, around the model call: mlx-lm's models take
no per-call arguments down to their layers). When no row has an adapter the wrapped layer is its base alone. Else,
three dense kernels whatever the mix: x @ A_all (every slot's R columns at once: [tokens, slots·R]), times a mask
keeping each row's own slot's columns, then addmm onto the base's output with B_all ([slots·R, out]); layers that
read the same input (q/k/v, gate/up: SharedInput) share one masked x A. The extra FLOPs (slots × a small rank) cost
nothing next to kernel launches: on an H200, 32 decode rows over 8 adapters on q/k/v/o of a Qwen3-0.6B shape took
14.4 ms a step with two mx.gather_mm a layer (65 µs a layer), 11.9 ms with three dense kernels a layer (~13 µs a
kernel), against 7.6 ms for the base model alone; all-one-adapter matmuls of (x A_k) B_k took 19 ms. So on a CUDA
GPU forwards of up to FUSED_MAX_TOKENS tokens (decode, verify) take one kernel of ours a layer or shared-input group
instead (kernels.py); longer ones (prefill) keep the dense form, whose extra operations are nothing next to theirs.
The stacks live outside the module tree (plain attributes): the model's parameters, dtype casts and memory reports
do not see them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from engine.adapters.kernels import MemberUpdate, fused_kernel_works, lora_rows
from engine.adapters.weights import AdapterWeights, linear_dims

FUSED_MAX_TOKENS = 256


@dataclass
class RowAdapters:
    """The adapter slots of one forward's rows, as a mask over the stacks' columns: row i keeps the R columns of its
    own slot ([rows, slots * R], or [1, slots * R] when every row has the same slot) and zeros the others."""

    mask: mx.array
    used: frozenset[int]
    slots: tuple[int, ...]  # one per batch row
    fused: bool  # the fused kernel (kernels.py) serves this forward's short inputs
    _tiled: dict[int, mx.array] = field(default_factory=dict, compare=False)
    _token_slots: dict[int, mx.array] = field(default_factory=dict, compare=False)

    def token_slots(self, x: mx.array) -> mx.array | None:
        """The slot of each token of x [rows, tokens, in] ([rows * tokens] int32) when the fused kernel takes x."""
        if not self.fused or x.ndim != 3 or x.shape[0] != len(self.slots) or x.shape[0] * x.shape[1] > FUSED_MAX_TOKENS:
            return None
        if x.shape[1] not in self._token_slots:
            self._token_slots[x.shape[1]] = mx.array([s for s in self.slots for _ in range(x.shape[1])], mx.int32)
        return self._token_slots[x.shape[1]]

    def mask_of(self, members: int) -> mx.array:
        """The mask over `members` layers' columns side by side (a shared-input group's)."""
        if members == 1:
            return self.mask
        if members not in self._tiled:
            self._tiled[members] = mx.tile(self.mask, (1, members))
        return self._tiled[members]


class ModuleStacks:
    """One wrapped layer's adapters: A [in, slots, R] and scale·B [slots, R, out] (a plain object: nn.Module would
    take the arrays for parameters)."""

    def __init__(self, base: nn.Module, in_dims: int, out_dims: int, num_slots: int, rank: int, dtype: mx.Dtype,
                 fused: bool) -> None:
        self.base = base
        self.dtype = dtype
        self.a = mx.zeros((in_dims, num_slots, rank), dtype)
        self.b = mx.zeros((num_slots, rank, out_dims), dtype)
        self.fused = fused
        self.a_rows: mx.array | None = None  # [slots, R, in]: the fused kernel's layout of A, where it serves
        self._lay_out_rows()
        self.targeted: set[int] = set()  # slots whose adapter updates this layer
        self.group: SharedInput | None = None  # the layers beside it that read the same input (q/k/v, gate/up)
        self.place = 0  # its place in that group

    def resize(self, num_slots: int, rank: int) -> None:
        """Grow to `num_slots` slots and rank `rank`, zero-filled (slots and ranks never shrink)."""
        in_dims, slots, old_rank = self.a.shape
        if rank > old_rank or num_slots > slots:
            self.a = mx.pad(self.a, [(0, 0), (0, num_slots - slots), (0, rank - old_rank)])
            self.b = mx.pad(self.b, [(0, num_slots - slots), (0, rank - old_rank), (0, 0)])
            self._lay_out_rows()

    def write(self, slot: int, a: mx.array | None, b: mx.array | None, scale: float) -> None:
        rank = self.a.shape[2]
        if a is None or b is None:
            self.a[:, slot, :] = mx.zeros((self.a.shape[0], rank), self.dtype)
            self.b[slot] = mx.zeros(self.b.shape[1:], self.dtype)
            self.targeted.discard(slot)
        else:
            self.a[:, slot, :] = mx.pad(a, [(0, 0), (0, rank - a.shape[1])]).astype(self.dtype)
            self.b[slot] = mx.pad(b * scale, [(0, rank - b.shape[0]), (0, 0)]).astype(self.dtype)
            self.targeted.add(slot)
        self._lay_out_rows()

    def _lay_out_rows(self) -> None:
        if self.fused:
            self.a_rows = mx.contiguous(self.a.transpose(1, 2, 0))

    def update(self, y: mx.array) -> MemberUpdate:
        return MemberUpdate(y.reshape(-1, y.shape[-1]), self.a_rows, self.b)

    def arrays(self) -> list[mx.array]:
        return [self.a, self.b] + ([self.a_rows] if self.a_rows is not None else [])


class MultiLoraLinear(nn.Module):
    """A linear layer plus the adapter update of each row's slot (see the module's docstring)."""

    def __init__(self, base: nn.Module, stacks: ModuleStacks, bank: "AdapterBank") -> None:
        super().__init__()
        self.base = base
        self._stacks = stacks
        self._bank = bank

    def __call__(self, x: mx.array) -> mx.array:
        rows, stacks = self._bank.rows, self._stacks
        if rows is None or not (stacks.targeted & rows.used):
            return self.base(x)
        token_slots = rows.token_slots(x)
        if token_slots is not None:
            if stacks.group is not None:
                return stacks.group.fused(x, rows, token_slots)[stacks.place]
            return fused_update(x, token_slots, [stacks])[0]
        y = self.base(x)
        if x.dtype != stacks.dtype:
            x = x.astype(stacks.dtype)
        if stacks.group is not None:  # x A of the whole group, made by its first layer called
            own, b = stacks.group.own(x, rows), stacks.group.b[stacks.place]
        else:
            in_dims, slots, rank = stacks.a.shape
            own = masked_product(x, stacks.a.reshape(in_dims, slots * rank), rows.mask)
            b = stacks.b.reshape(slots * rank, -1)
        if y.dtype != stacks.dtype:
            own, b = own.astype(y.dtype), b.astype(y.dtype)
        return mx.addmm(y.reshape(-1, y.shape[-1]), own, b).reshape(y.shape)


def fused_update(x: mx.array, token_slots: mx.array, members: list[ModuleStacks]) -> list[mx.array]:
    """Each member layer's output on x with its rows' updates, by one kernel (kernels.py)."""
    bases = [member.base(x) for member in members]
    dtype = members[0].dtype
    outputs = lora_rows(x.reshape(-1, x.shape[-1]).astype(dtype), token_slots,
                        [member.update(y.astype(dtype)) for member, y in zip(members, bases)])
    return [out.reshape(y.shape).astype(y.dtype) for out, y in zip(outputs, bases)]


def masked_product(x: mx.array, a: mx.array, mask: mx.array) -> mx.array:
    """x @ a ([tokens, columns]) with each batch row's columns outside its own slot's zeroed."""
    every = x.reshape(-1, x.shape[-1]) @ a
    return (every.reshape(x.shape[0], -1, a.shape[1]) * mask[:, None, :]).reshape(-1, a.shape[1])


# Layers of one block that mlx-lm's models call with the same input: their x A is one matmul.
SHARED_INPUTS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class SharedInput:
    """Sibling layers that read the same input: A of all of them side by side ([in, members * slots * R]), and each
    one's B placed at its own rows of a [members * slots * R, out] (zeros elsewhere), so that the one masked x A
    serves every member's addmm. Kernels a layer on the H200: q/k/v 5 instead of 9."""

    def __init__(self, members: list[ModuleStacks]) -> None:
        in_dims, slots, rank = members[0].a.shape
        width = slots * rank
        self.a = mx.concatenate([m.a.reshape(in_dims, width) for m in members], axis=1)
        self.b = [mx.pad(m.b.reshape(width, -1), [(i * width, (len(members) - 1 - i) * width), (0, 0)])
                  for i, m in enumerate(members)]
        self.members = len(members)
        self._stacks = members
        self._last: tuple[mx.array, RowAdapters, mx.array] | None = None
        self._last_fused: tuple[mx.array, RowAdapters, list[mx.array]] | None = None
        for place, member in enumerate(members):
            member.group, member.place = self, place

    def own(self, x: mx.array, rows: RowAdapters) -> mx.array:
        if self._last is not None and self._last[0] is x and self._last[1] is rows:
            return self._last[2]
        own = masked_product(x, self.a, rows.mask_of(self.members))
        self._last = (x, rows, own)
        return own

    def fused(self, x: mx.array, rows: RowAdapters, token_slots: mx.array) -> list[mx.array]:
        """Every member's output on x, updates included, made by the first member called (mlx-lm's models call
        q/k/v, gate/up one after the other on the same x; lazy arrays: the others' bases run in the same graph)."""
        if self._last_fused is None or self._last_fused[0] is not x or self._last_fused[1] is not rows:
            self._last_fused = (x, rows, fused_update(x, token_slots, self._stacks))
        return self._last_fused[2]

    def forget(self) -> None:
        self._last = self._last_fused = None

    def arrays(self) -> list[mx.array]:
        return [self.a, *self.b]


def compute_dtype(module: nn.Module) -> mx.Dtype:
    """The dtype a linear layer computes in: its weight's, or a quantized one's scales'."""
    for name, array in tree_flatten(module.parameters()):
        if name.endswith("scales") or (name.endswith("weight") and mx.issubdtype(array.dtype, mx.floating)):
            return array.dtype
    return mx.float32


@dataclass
class AdapterBank:
    """The model's per-row adapters: its wrapped layers' stacks, and the rows of the forward being built."""

    model: nn.Module
    num_slots: int = 1  # slot 0: no adapter
    rank: int = 1
    rows: RowAdapters | None = None
    _stacks: dict[str, ModuleStacks] = field(default_factory=dict)
    _groups: list[SharedInput] = field(default_factory=list)
    dtype: mx.Dtype = mx.float32  # the stacks' and masks': the model's compute dtype
    fused: bool = field(default_factory=fused_kernel_works)  # short forwards take the fused kernel (CUDA GPU)
    _last_rows: tuple[tuple, RowAdapters | None] | None = None

    def write(self, slot: int, weights: AdapterWeights) -> None:
        """Put an adapter in `slot` (>= 1), replacing what was there; layers it targets are wrapped on first use."""
        self.num_slots, self.rank = max(self.num_slots, slot + 1), max(self.rank, weights.rank)
        self._wrap(path for path in weights.deltas if path not in self._stacks)
        for path, stacks in self._stacks.items():
            stacks.resize(self.num_slots, self.rank)
            delta = weights.deltas.get(path)
            stacks.write(slot, delta.a if delta else None, delta.b if delta else None, delta.scale if delta else 0.0)
        self._group_shared_inputs()
        self._evaluate()

    def _group_shared_inputs(self) -> None:
        for stacks in self._stacks.values():
            stacks.group = None
        self._groups = []
        parents = dict.fromkeys(path.rpartition(".")[0] for path in self._stacks)
        for parent in parents:
            for names in SHARED_INPUTS:
                members = [self._stacks[f"{parent}.{n}"] for n in names if f"{parent}.{n}" in self._stacks]
                if len(members) > 1:
                    self._groups.append(SharedInput(members))

    @property
    def nbytes(self) -> int:
        return sum(array.nbytes for array in self._arrays())

    @contextlib.contextmanager
    def applying(self, slots: Sequence[int]) -> Iterator[None]:
        """Forwards built inside use these slots, one per batch row (padding rows: 0)."""
        self.rows = self._rows_of(tuple(slots))
        try:
            yield
        finally:
            self.rows = None
            for group in self._groups:
                group.forget()

    def _rows_of(self, slots: tuple[int, ...]) -> RowAdapters | None:
        key = (slots, self.num_slots, self.rank, self.fused)
        if self._last_rows is not None and self._last_rows[0] == key:  # decode: the same rows step after step
            return self._last_rows[1]
        used = frozenset(slots) - {0}
        rows = None
        if used:
            rows_slots = mx.array(slots[:1] if len(set(slots)) == 1 else slots, mx.int32)
            column_slots = mx.arange(self.num_slots * self.rank) // self.rank
            mask = (rows_slots[:, None] == column_slots[None, :]).astype(self.dtype)
            rows = RowAdapters(mask, used, slots, self.fused)
        self._last_rows = (key, rows)
        return rows

    def _wrap(self, paths) -> None:
        modules = dict(self.model.named_modules())
        wrapped = []
        for path in paths:
            in_dims, out_dims = linear_dims(modules[path])
            self.dtype = compute_dtype(modules[path])
            stacks = self._stacks[path] = ModuleStacks(modules[path], in_dims, out_dims, self.num_slots, self.rank,
                                                       self.dtype, self.fused)
            wrapped.append((path, MultiLoraLinear(modules[path], stacks, self)))
        if wrapped:
            self.model.update_modules(tree_unflatten(wrapped))

    def _arrays(self) -> list[mx.array]:
        return ([array for stacks in self._stacks.values() for array in stacks.arrays()]
                + [array for group in self._groups for array in group.arrays()])

    def _evaluate(self) -> None:
        mx.eval(self._arrays())


__all__ = ["AdapterBank", "MultiLoraLinear", "RowAdapters"]
