"""What a model's output parses into: neutral content, reasoning and tool-call deltas (no wire format).

A contract between deployments: the model side's parsers (chat/parsers/) produce these and StreamChunk
(model_calls.py) carries them; the ingress's renderers (api/) turn them into OpenAI or Anthropic events.
"""

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

    def joined(self, later: ToolCallDelta) -> ToolCallDelta:
        """This delta and a later one of the same call as one."""
        return ToolCallDelta(self.index, self.arguments + later.arguments, self.id or later.id,
                             self.name or later.name, self.unfinished or later.unfinished)


ParsedEvent = ContentDelta | ReasoningDelta | ToolCallDelta
