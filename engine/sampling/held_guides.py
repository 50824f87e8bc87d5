"""The compiled structured-output guides of one engine's requests, held by key from a request's arrival until it
finishes (plain Python, engine thread only).

The scheduler -> runner contract is plain data: a NewRequest names its guide by key (its sampling's
GuidedDecoding, which identifies a compiled guide within one model's tokenizer) and the runner resolves it here,
once, when it makes the request's sampling row. The process-wide compile cache (structured.py) is an LRU that may
drop a guide meanwhile; a request's hold keeps its guide resolvable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.sampling.guided import GuidedDecoding
    from engine.sampling.structured import CompiledGuide


@dataclass
class _HeldGuide:
    guide: "CompiledGuide"
    holders: int


class HeldGuides:
    def __init__(self) -> None:
        self._held: dict["GuidedDecoding", _HeldGuide] = {}

    def hold(self, key: "GuidedDecoding", guide: "CompiledGuide") -> None:
        """A request of this guide arrived (requests of one spec share the first one's compiled guide)."""
        held = self._held.get(key)
        if held is None:
            self._held[key] = _HeldGuide(guide, 1)
        else:
            held.holders += 1

    def release(self, key: "GuidedDecoding") -> None:
        """A request of this guide finished; the guide is dropped with its last holder."""
        held = self._held[key]
        held.holders -= 1
        if not held.holders:
            del self._held[key]

    def resolve(self, key: "GuidedDecoding | None") -> "CompiledGuide | None":
        """The compiled guide held under `key` (None: an unguided request)."""
        return None if key is None else self._held[key].guide

    def __len__(self) -> int:
        return len(self._held)
