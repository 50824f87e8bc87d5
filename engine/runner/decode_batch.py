"""The running decode batch: one batched KV cache, row order, per-row sampling."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import mlx.core as mx

from engine.kv import plain_batch, quantized_kv
from engine.kv.batch_cache import (
    LayerCaches,
    extend_batch_cache,
    extract_request_cache,
    filter_batch_cache,
    merge_request_caches,
)
from engine.sampling.held_guides import HeldGuides
from engine.sampling.params import SamplingParams, seed_to_uint32
from engine.sampling.sampler import BatchSampler, RowSampling
from engine.sampling.structured import GuideState
from engine.scheduler_output import NewRequest


# Rows that left the batch but still sit in its KV (see DecodeBatch.defer_leaves): their ids start with this (no
# request id does: the engine's ids are printable) and their tokens are never read out.
DEAD_ROW_PREFIX = "\0dead-row-"
_DEAD_ROW_PARAMS = SamplingParams(temperature=0.0)
# Rows leaving stay dead past half the batch while the live rows end within this many steps: removing rows costs a
# few steps (on an H200 at 128 rows, 13-59 ms against ~10 ms a step), and rows of one burst end steps apart.
FINISHING_STEPS = 4


def is_dead_row(request_id: str) -> bool:
    return request_id.startswith(DEAD_ROW_PREFIX)


def new_row_sampling(request: NewRequest, guides: HeldGuides, rng: random.Random) -> RowSampling:
    """A request's sampling row, made with its first token: its seed and token history follow it, and its
    structured-output guide, resolved by key where it has one."""
    params = request.sampling
    seed = params.seed if params.seed is not None else rng.getrandbits(32)
    prompt_set = frozenset(request.prompt_token_ids) if params.repetition_penalty != 1.0 else frozenset()
    guide = guides.resolve(request.guide_key)
    state = GuideState(guide) if guide is not None else None
    return RowSampling(params=params, seed=seed_to_uint32(seed), prompt_token_set=prompt_set, guide=state)


@dataclass(frozen=True)
class Membership:
    """How a step's rows come from the previous step's: row i of the kept ones was row keep_rows[i]; joiner i (in
    the order asked) sits at row joiner_rows[i], after the kept rows or over rows no request held (fill)."""

    keep_rows: list[int]
    joiner_rows: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Upcoming:
    """Prompts completing beside the batch, which join it next step: how many, and the most positions one of them
    may write once it has (its max_tokens, a step on): a batch rebuilt now keeps rows and room for them."""

    rows: int = 0
    room: int = 0

    @classmethod
    def of(cls, max_tokens: list[int | None], limit: int) -> "Upcoming":
        """The joiners of these max_tokens, no more than `limit` (the rows free to decode)."""
        joining = max_tokens[: max(0, limit)]
        return cls(len(joining), max(((n or 1) + 1 for n in joining), default=0))


@dataclass
class DecodeBatch:
    vocab_size: int
    request_ids: list[str] = field(default_factory=list)
    caches: LayerCaches = field(default_factory=list)
    rows: dict[str, RowSampling] = field(default_factory=dict)
    sampler: BatchSampler | None = None
    # False while one sequence runs on its plain (unbatched) mlx-lm cache.
    is_batched: bool = False
    # Rows' left padding, host-side, while the batch is built from plain KV caches (kv/plain_batch.py) or quantized
    # ones (kv/quantized_kv.py); None for other cache types, which go through mlx-lm's merge / extend / filter.
    padding: list[int] | None = None
    # Rows whose text positions are shifted from their KV's (a VLM's rope delta) have the shift folded into the
    # batch cache's offsets (what mlx-lm's models rotate by; the mask reads the padding): then a plain text model
    # decodes them. False: a row's shift could not be folded (a non-plain cache).
    shifts_folded: bool = True
    # Rows that leave while none joins stay in the KV as dead rows (decoded, their tokens dropped) until half the
    # batch is dead or rows join: removing them copies every layer's whole KV, and on an H200 at 128 rows the
    # steps that dropped 8 rows took 15-65 ms against ~8 ms for a full step, where a dead row costs a row of a step.
    # On a GPU only (the runner's choice: on the CPU a step's cost grows with its rows; there two paired runs of 8
    # staggered rows of the Qwen3-0.6B shape gave 0.92 and 1.03, on / off), and not where rows' inputs come from the
    # host (speculative decoding's verify steps). There, joiners are written over dead rows in place where they fit,
    # and a batch built or grown for joiners keeps vacant (dead) rows for the prompts completing beside them.
    defer_leaves: bool = False
    _dead_rows_made: int = 0

    def __len__(self) -> int:
        return len(self.request_ids)

    @property
    def num_dead_rows(self) -> int:
        return sum(1 for rid in self.request_ids if is_dead_row(rid))

    @property
    def num_live_rows(self) -> int:
        return len(self.request_ids) - self.num_dead_rows

    def update_membership(
        self, request_ids: list[str], joiner_caches: dict[str, LayerCaches], all_rows: dict[str, RowSampling],
        joiner_blocks: dict[str, plain_batch.RowBlock] | None = None, position_shifts: dict[str, int] | None = None,
        room: int = 1, upcoming: Upcoming = Upcoming(),
    ) -> Membership:
        """Make the batch exactly `request_ids` (kept rows keep their order; joiners go last, or over dead rows).
        `joiner_blocks` says where a joiner's KV sits in a batched prefill cache (plain caches only),
        so that adjacent rows join together. `position_shifts`: rows whose positions to fold into the offsets.
        `room`: the most tokens a row may still write, reserved in a plain batch's buffers when rows join.
        `upcoming`: rows joining next step, kept vacant, with their room, where the batch is rebuilt
        (defer_leaves).
        """
        wanted = set(request_ids)
        current = set(self.request_ids)
        joiners = [rid for rid in request_ids if rid not in current]
        leaving = [i for i, rid in enumerate(self.request_ids) if rid not in wanted and not is_dead_row(rid)]
        if not joiners and (not (leaving or self.num_dead_rows) or self._keeps_as_dead(len(leaving), 0, room)):
            self._make_dead(leaving)
            return Membership(list(range(len(self.request_ids))))
        filled = self._fill_dead_rows(joiners, leaving, joiner_caches, all_rows, joiner_blocks or {}, room) \
            if joiners else None
        if filled is not None:
            self._fold_shifts(position_shifts or {})  # the fill laid the offsets out anew
            return Membership(list(range(len(self.request_ids))), filled)
        keep_rows = [i for i, rid in enumerate(self.request_ids) if rid in wanted]
        if len(keep_rows) != len(self.request_ids):
            self._filter(keep_rows)
            self.request_ids = [self.request_ids[i] for i in keep_rows]
            self.rows = {rid: self.rows[rid] for rid in self.request_ids}
        shifts = position_shifts or {}
        if joiners:
            lone = not self.request_ids and len(joiners) == 1 and not shifts.get(joiners[0])
            vacant = upcoming.rows if self.defer_leaves and not lone else 0
            self._add_joiners(joiners, [joiner_caches[rid] for rid in joiners], all_rows, joiner_blocks or {}, lone,
                              max(room, upcoming.room) if vacant else room, vacant)
        self._fold_shifts(shifts)
        rows = [self.rows[rid] for rid in self.request_ids]
        self.sampler = BatchSampler(rows, self.vocab_size) if rows else None
        return Membership(keep_rows, list(range(len(keep_rows), len(keep_rows) + len(joiners))))

    def _keeps_as_dead(self, num_leaving: int, num_joining: int, room: int) -> bool:
        """Whether rows leaving can stay as dead rows (joiners taking dead rows' places): a batch of plain or
        quantized KV in which at least one row lives on and at most half the rows are then dead, or whose live
        rows all end within FINISHING_STEPS."""
        dead = self.num_dead_rows + num_leaving - num_joining
        if not (self.defer_leaves and self.is_batched and self.padding is not None and dead < len(self.request_ids)):
            return False
        return dead * 2 <= len(self.request_ids) or room <= FINISHING_STEPS

    def _fill_dead_rows(
        self, joiners: list[str], leaving: list[int], caches: dict[str, LayerCaches], all_rows: dict[str, RowSampling],
        blocks: dict[str, plain_batch.RowBlock], room: int,
    ) -> list[int] | None:
        """Joiners written in place over dead rows and rows leaving now, in row order, where the batch is plain
        KV that holds them all (their prompts within its index, its buffers the room); their rows, else None."""
        if not self.defer_leaves or self.padding is None or not self.is_batched:
            return None
        free = sorted([i for i, rid in enumerate(self.request_ids) if is_dead_row(rid)] + leaving)
        if len(free) < len(joiners) or quantized_kv.is_quantized_batch(self.caches):
            return None
        if not all(plain_batch.is_plain_request_cache(caches[rid]) for rid in joiners):
            return None
        placed = [blocks.get(rid) or plain_batch.RowBlock.of_request(caches[rid]) for rid in joiners]
        if not plain_batch.fits_in_place(self.caches, placed, room) or not self._keeps_as_dead(
                len(leaving), len(joiners), room):
            return None
        slots = free[: len(joiners)]
        self.padding = plain_batch.fill_rows(self.caches, self.padding, slots, plain_batch.merged_blocks(placed))
        for row in leaving:
            self.rows.pop(self.request_ids[row])
        for slot, request_id in zip(slots, joiners):
            self.rows.pop(self.request_ids[slot], None)
            self.request_ids[slot] = request_id
            self.rows[request_id] = all_rows[request_id]
        self._make_dead([row for row in leaving if row not in slots], forgotten=True)
        return slots

    def _make_dead(self, rows: list[int], forgotten: bool = False) -> None:
        """These rows' requests leave (`forgotten`: their sampling rows are gone already); their KV rows stay,
        decoded greedily, under ids no request has. The sampler is rebuilt."""
        for row in rows:
            if not forgotten:
                self.rows.pop(self.request_ids[row])
            self.request_ids[row] = self._new_dead_row()
        if rows or forgotten:
            self.sampler = BatchSampler([self.rows[rid] for rid in self.request_ids], self.vocab_size)

    def row_cache(self, row: int) -> LayerCaches:
        """One row's KV as a single-request cache (lazy slices: take it before the batch changes)."""
        if not self.is_batched:
            return self.caches
        if self.padding is not None:
            return self._rows_module().row_cache(self.caches, self.padding, row)
        return extract_request_cache(self.caches, row)

    def _rows_module(self):
        """The module that joins, filters and slices this batch's rows (padding is host-side)."""
        return quantized_kv if quantized_kv.is_quantized_batch(self.caches) else plain_batch

    def _filter(self, keep_rows: list[int]) -> None:
        if not keep_rows:
            self.caches, self.padding, self.is_batched = [], None, False
        elif self.padding is not None:
            self.caches, self.padding = self._rows_module().filter_rows(self.caches, self.padding, keep_rows)
        else:
            self.caches = filter_batch_cache(self.caches, keep_rows)

    def _add_joiners(
        self, joiners: list[str], caches: list[LayerCaches], all_rows: dict[str, RowSampling],
        blocks: dict[str, plain_batch.RowBlock], lone: bool, room: int, vacant: int = 0,
    ) -> None:
        if lone:
            # A lone sequence decodes on its own cache: no padding mask, as fast as mlx-lm's generate_step.
            self.caches, self.is_batched, self.padding = caches[0], False, None
        else:
            placed = [blocks.get(rid) for rid in joiners]  # where each joiner's KV already sits, if known
            if self.request_ids and not self.is_batched:  # the lone sequence becomes the first row
                caches, placed, self.caches, self.padding = [self.caches, *caches], [None, *placed], [], []
            elif not self.request_ids:
                self.padding = []
            if self.padding is not None and all(quantized_kv.is_quantized_request_cache(c) for c in caches):
                self.caches, self.padding = quantized_kv.append_rows(self.caches, self.padding, caches)
            elif self.padding is not None and all(plain_batch.is_plain_request_cache(c) for c in caches):
                rows = [b or plain_batch.RowBlock.of_request(c) for b, c in zip(placed, caches)]
                self.caches, self.padding = plain_batch.append_rows(
                    self.caches, self.padding, plain_batch.merged_blocks(rows), room, vacant)
            else:
                self._extend_through_mlx_lm(caches)
            self.is_batched = True
        for request_id in joiners:
            self.rows[request_id] = all_rows[request_id]
            self.request_ids.append(request_id)
        if vacant and self.padding is not None:  # the vacant rows append_rows laid out: dead from the start
            self.request_ids += [self._new_dead_row() for _ in range(len(self.padding) - len(self.request_ids))]

    def _new_dead_row(self) -> str:
        """An id no request has, with its greedy sampling row."""
        self._dead_rows_made += 1
        dead_id = f"{DEAD_ROW_PREFIX}{self._dead_rows_made}"
        self.rows[dead_id] = RowSampling(params=_DEAD_ROW_PARAMS, seed=0)
        return dead_id

    def _fold_shifts(self, shifts: dict[str, int]) -> None:
        """The rows' shifts added to the offsets the batch was just (re)built with, on every layer (one array)."""
        values = [shifts.get(rid, 0) for rid in self.request_ids]
        self.shifts_folded = not any(values)
        if self.shifts_folded or self.padding is None or quantized_kv.is_quantized_batch(self.caches):
            return
        offsets = self.caches[0].offset + mx.array(values)
        for cache in self.caches:
            cache.offset = offsets
        self.shifts_folded = True

    def _extend_through_mlx_lm(self, caches: list[LayerCaches]) -> None:
        if self.padding:  # a plain batch meeting a joiner of another cache type (not seen in practice)
            raise TypeError("a batch of plain KV caches cannot take rows of another cache type")
        self.padding = None
        self.caches = extend_batch_cache(self.caches, merge_request_caches(caches))

    @staticmethod
    def record_tokens(sampled: list[SampledToken], rows: dict[str, RowSampling]) -> None:
        """Feed read-back tokens to the rows whose penalties or guides follow them."""
        for token in sampled:
            row = rows.get(token.request_id)
            if row is not None and row.params.needs_token_history:
                row.record(token.token_id)

    def top_logprob_counts(self) -> list[int]:
        return [self.rows[rid].params.top_logprobs for rid in self.request_ids]


def step_inputs(previous_tokens: mx.array, membership: Membership, firsts: list[int], num_rows: int) -> mx.array:
    """A decode step's `num_rows` inputs: kept rows' tokens sampled last step (lazy), joiners' first tokens at their
    rows, 0 for vacant rows after them."""
    keep_rows, joiner_rows = membership.keep_rows, membership.joiner_rows
    if joiner_rows and joiner_rows[0] < len(keep_rows):  # joiners over dead rows: every row was kept
        is_joiner, values = [False] * num_rows, [0] * num_rows
        for row, token in zip(joiner_rows, firsts):
            is_joiner[row], values[row] = True, token
        return mx.where(mx.array(is_joiner), mx.array(values, previous_tokens.dtype), previous_tokens)
    parts = []
    if keep_rows:
        whole = len(keep_rows) == previous_tokens.shape[0]
        parts.append(previous_tokens if whole else previous_tokens[mx.array(keep_rows)])
    if num_rows > len(keep_rows):
        parts.append(mx.array(firsts + [0] * (num_rows - len(keep_rows) - len(firsts)), previous_tokens.dtype))
    return parts[0] if len(parts) == 1 else mx.concatenate(parts)


__all__ = ["DecodeBatch", "Membership", "Upcoming", "is_dead_row", "new_row_sampling", "step_inputs"]
