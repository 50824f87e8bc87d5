"""Streaming tool-call extraction for marker-delimited formats (see tool_formats.py).

Text outside call blocks streams out as content; a block is held until its end marker and
then emitted as whole calls (id and name with the complete arguments), so a partial call
never reaches the client until the output ends inside it: cut by max_tokens, it goes out marked
unfinished. Whitespace between content and calls is dropped.
"""

from __future__ import annotations

import logging
import uuid
from typing import Callable

from deployments.output_deltas import ContentDelta, ParsedEvent, ToolCallDelta
from deployments.chat.parsers.lexer import Marker, MarkerLexer
from deployments.chat.parsers.tool_formats import MalformedCall, ParamTypes, ToolFormat
from deployments.chat.parsers.trim import EdgeTrim

logger = logging.getLogger(__name__)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallParser:
    def __init__(
        self,
        tool_format: ToolFormat,
        types: ParamTypes | None = None,
        max_calls: int | None = None,
        new_id: Callable[[], str] = new_call_id,
    ) -> None:
        self._format = tool_format
        self._types = types or {}
        self._max_calls = max_calls
        self._new_id = new_id
        self._lexer = MarkerLexer()
        self._block: list[str] | None = None  # the open call block's text; None outside blocks
        self._content = EdgeTrim()
        self._num_calls = 0

    def feed(self, text: str) -> list[ParsedEvent]:
        self._lexer.feed(text)
        return self._drain()

    def finish(self, cut: bool = False) -> list[ParsedEvent]:
        """`cut`: the output ended at max_tokens, so a block still open is an unfinished call."""
        self._lexer.finish()
        events = self._drain()
        if self._block is not None:  # the output ended inside a block (max_tokens, or a stop token as end)
            events += self._close_block(unfinished=cut)
        events.append(ContentDelta(self._content.flush()))
        return [e for e in events if not isinstance(e, ContentDelta) or e.text]

    def _markers(self) -> tuple[str, ...]:
        return (self._format.end,) if self._block is not None else (self._format.start,)

    def _drain(self) -> list[ParsedEvent]:
        events: list[ParsedEvent] = []
        for token in self._lexer.tokens(self._markers):
            if isinstance(token, Marker) and self._block is None:
                self._content.drop_pending()
                self._block = []
            elif isinstance(token, Marker):
                events += self._close_block()
            elif self._block is not None:
                self._block.append(token.text)
            else:
                events.append(ContentDelta(self._content.text(token.text)))
        return [e for e in events if not isinstance(e, ContentDelta) or e.text]

    def _close_block(self, unfinished: bool = False) -> list[ParsedEvent]:
        text = "".join(self._block or [])
        self._block = None
        self._content.restart(strip_leading=True)
        # An unfinished call's arguments are its text as written so far, trailing spaces included.
        body = text.lstrip() if unfinished else text.strip()
        parse = self._format.parse_unfinished if unfinished else self._format.parse_block
        try:
            calls = parse(body, self._types)
        except MalformedCall as exc:
            if unfinished:  # half a call's markup is no answer: the finish reason (length) tells the client
                logger.info("%s tool call cut before it was readable (%s); dropped", self._format.name, exc)
                return []
            # Unreadable as a call: its text (never the markers) goes out as content.
            logger.info("%s tool call not understood (%s); sent as content", self._format.name, exc)
            return [ContentDelta(body)]
        events: list[ParsedEvent] = []
        for call in calls:
            if self._max_calls is not None and self._num_calls >= self._max_calls:
                logger.info("tool call '%s' dropped: parallel_tool_calls is false", call.name)
                continue
            events.append(ToolCallDelta(self._num_calls, call.arguments, self._new_id(), call.name, call.unfinished))
            self._num_calls += 1
        return events
