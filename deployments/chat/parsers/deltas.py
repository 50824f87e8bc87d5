"""What output parsers produce: neutral content, reasoning and tool-call deltas (no wire format)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ContentDelta:
    text: str


@dataclass
class ReasoningDelta:
    text: str


@dataclass
class ToolCallDelta:
    """Part of tool call number `index` (0-based, in order of appearance in the output).

    The first delta of a call carries its id and name; later ones only argument fragments.
    `arguments` is JSON text: the fragments of one call concatenate to the arguments object.
    `unfinished`: the output was cut (max_tokens) inside this call, so `arguments` is the text written so far.
    """

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None
    unfinished: bool = False


ParsedEvent = ContentDelta | ReasoningDelta | ToolCallDelta


def merge_events(events: list[ParsedEvent]) -> list[ParsedEvent]:
    """Adjacent deltas of the same kind (and the same tool call) joined: a canonical form."""
    merged: list[ParsedEvent] = []
    for event in events:
        last = merged[-1] if merged else None
        if isinstance(event, ContentDelta) and isinstance(last, ContentDelta):
            merged[-1] = ContentDelta(last.text + event.text)
        elif isinstance(event, ReasoningDelta) and isinstance(last, ReasoningDelta):
            merged[-1] = ReasoningDelta(last.text + event.text)
        elif isinstance(event, ToolCallDelta) and isinstance(last, ToolCallDelta) and last.index == event.index:
            merged[-1] = ToolCallDelta(last.index, last.arguments + event.arguments, last.id or event.id,
                                       last.name or event.name, last.unfinished or event.unfinished)
        elif not (isinstance(event, (ContentDelta, ReasoningDelta)) and not event.text):
            merged.append(event)
    return merged
