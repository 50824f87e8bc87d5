"""Copies of completed prompts into the prefix cache, deferred to the next step (see PromptCopies)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.kv.block_store import KVBlockStore
from engine.runner.prefill import PrefillResult
from engine.scheduler_output import PrefillChunk


# ---- copies of completed prompts into the prefix cache ------------------------------------------------------
# A step's completed prompts are kept until the next step: their copies cost CPU time (~15 ms for 32 prompts of
# 517 tokens on an H100) that the next step's new prompts would otherwise wait for, so the runner makes them once
# those prompts are on the device, or before scheduling when the scheduler says a waiting request may hit them.
@dataclass
class PrefilledPrompts:
    """One step's prefill chunks, their requests' whole prompts and the forward's result."""

    chunks: list[PrefillChunk]
    prompts: list[tuple[int, ...]]
    result: PrefillResult


class PromptCopies:
    def __init__(self, blocks: KVBlockStore) -> None:
        self._blocks = blocks
        self._pending: list[PrefilledPrompts] = []

    def keep(self, prefilled: PrefilledPrompts) -> None:
        if any(chunk.cache_prompt for chunk in prefilled.chunks):
            self._pending.append(prefilled)

    def take(self) -> list[PrefilledPrompts]:
        pending, self._pending = self._pending, []
        return pending

    def __bool__(self) -> bool:
        return bool(self._pending)

    def copy(self, prefilled: list[PrefilledPrompts]) -> None:
        """Cache the prompts their chunks completed: padded forwards' rows together, others one by one."""
        for prompts in prefilled:
            inserted = self._copy_shared_rows(prompts)
            for i, (chunk, cache) in enumerate(zip(prompts.chunks, prompts.result.caches)):
                if i not in inserted and chunk.cache_prompt:
                    self._blocks.insert(prompts.prompts[i], cache)
        if prefilled:
            self._blocks.flush()

    def _copy_shared_rows(self, prompts: PrefilledPrompts) -> set[int]:
        """Prompts of one padded forward are copied from its batched cache at once."""
        inserted: set[int] = set()
        for shared in prompts.result.shared:
            wanted = [(position, i) for position, i in enumerate(shared.rows) if prompts.chunks[i].cache_prompt]
            token_ids = [prompts.prompts[i] for _, i in wanted]
            if len(wanted) > 1 and self._blocks.insert_rows(token_ids, shared.caches, [p for p, _ in wanted]):
                inserted.update(i for _, i in wanted)
        return inserted

    def clear(self) -> None:
        self._pending = []
