"""The runner's side of per-request adapters (engine/adapters/bank.py): the slot each row of a forward runs on.

Decode and verify forwards hold rows of any adapters at once (the bank gathers per row). Prefill forwards run one
adapter each: the step's chunks are ordered by slot and each slot's chunks prefill together, since the padded
prefill's forwards share rows in ways a per-row slot list would have to follow. Until an adapter is loaded none of
this runs.
"""

from __future__ import annotations

import contextlib
from itertools import groupby
from typing import Callable, ContextManager, Sequence

from engine.adapters.served import ServedAdapters
from engine.kv.batch_cache import LayerCaches
from engine.runner.prefill import PrefillResult
from engine.scheduler_output import NewRequest, PrefillChunk


class AdapterRows:
    def __init__(self, adapters: ServedAdapters | None, requests: dict[str, NewRequest]) -> None:
        self._adapters = adapters
        self._requests = requests  # the runner's own: request id -> its NewRequest (adapter_slot)

    @property
    def _active(self) -> bool:
        """An adapter was ever loaded (before that, forwards are the base model's, untouched)."""
        return self._adapters is not None and self._adapters.active

    def _slot(self, request_id: str) -> int:
        request = self._requests.get(request_id)  # none for a decode batch's dead rows: the base model's slot
        return request.adapter_slot if request is not None else 0

    def rows(self, request_ids: Sequence[str]) -> ContextManager:
        """Around a forward whose batch rows are these requests', in order."""
        if not self._active:
            return contextlib.nullcontext()
        return self._adapters.bank.applying([self._slot(rid) for rid in request_ids])

    def ordered(self, chunks: list[PrefillChunk]) -> list[PrefillChunk]:
        """Chunks of one adapter next to each other (stable: the base model's first)."""
        if not self._active:
            return chunks
        return sorted(chunks, key=lambda chunk: self._slot(chunk.request_id))

    def prefill(
        self, chunks: list[PrefillChunk], caches: list[LayerCaches],
        run: Callable[[list[PrefillChunk], list[LayerCaches]], PrefillResult],
    ) -> PrefillResult:
        """`run` once per adapter over its chunks (ordered by `ordered`), the results joined in chunk order."""
        if not self._active:
            return run(chunks, caches)
        result: PrefillResult | None = None
        start = 0
        for slot, group in groupby(chunks, key=lambda chunk: self._slot(chunk.request_id)):
            part = list(group)
            with self._adapters.bank.applying([slot]):
                ran = run(part, caches[start : start + len(part)])
            result = ran if result is None else result.followed_by(ran)
            start += len(part)
        return result if result is not None else PrefillResult([], [], None)
