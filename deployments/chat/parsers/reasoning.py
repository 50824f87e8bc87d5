"""`<think>...</think>` reasoning (Qwen3, DeepSeek-R1, GLM-4.5, MiniMax-M2): reasoning vs content.

A model whose prompt already ends with `<think>` (Qwen3 thinking models, R1) starts inside the
reasoning and only writes `</think>`; `starts_in_reasoning` is decided from the rendered prompt.
`<think>` opens reasoning only at the start of the output; later it is ordinary text.
"""

from __future__ import annotations

from enum import Enum

from deployments.output_deltas import ContentDelta, ParsedEvent, ReasoningDelta
from deployments.chat.parsers.lexer import Marker, MarkerLexer
from deployments.chat.parsers.trim import EdgeTrim

THINK_START = "<think>"
THINK_END = "</think>"


class _State(Enum):
    START = "start"
    REASONING = "reasoning"
    CONTENT = "content"


class ThinkReasoningParser:
    def __init__(self, starts_in_reasoning: bool = False) -> None:
        self._lexer = MarkerLexer()
        self._state = _State.REASONING if starts_in_reasoning else _State.START
        self._reasoning = EdgeTrim(strip_leading=True)
        self._content = EdgeTrim(strip_leading=True)

    def feed(self, text: str) -> list[ParsedEvent]:
        self._lexer.feed(text)
        return self._drain()

    def finish(self) -> list[ParsedEvent]:
        self._lexer.finish()
        events = self._drain()
        if self._state is _State.REASONING:
            events.append(ReasoningDelta(self._reasoning.flush()))
        events.append(ContentDelta(self._content.flush()))
        return [e for e in events if e.text]

    def _markers(self) -> tuple[str, ...]:
        return {_State.START: (THINK_START,), _State.REASONING: (THINK_END,), _State.CONTENT: ()}[self._state]

    def _drain(self) -> list[ParsedEvent]:
        events: list[ParsedEvent] = []
        for token in self._lexer.tokens(self._markers):
            if isinstance(token, Marker):
                if token.text == THINK_START:
                    self._state = _State.REASONING
                else:
                    self._reasoning.drop_pending()  # whitespace before </think> is not reasoning
                    self._state = _State.CONTENT
                continue
            if self._state is _State.START and token.text.strip():
                self._state = _State.CONTENT
            if self._state is _State.REASONING:
                events.append(ReasoningDelta(self._reasoning.text(token.text)))
            elif self._state is _State.CONTENT:
                events.append(ContentDelta(self._content.text(token.text)))
            # START with whitespace only: leading whitespace before <think> or content is dropped
        return [e for e in events if e.text]


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """True when the rendered prompt leaves the model inside a `<think>` block."""
    tail = prompt_text.rstrip()
    return tail.endswith(THINK_START)
