"""gpt-oss's harmony format: channels carry reasoning (analysis), content (final, commentary
preambles) and tool calls (a commentary message addressed `to=functions.NAME`).

The model writes `<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>json]<|message|>BODY` then
`<|end|>` (more messages follow after `<|start|>assistant`), `<|call|>` or `<|return|>`; the last
two are stop tokens, so the output usually just ends. Needs special tokens kept in the text.
"""

from __future__ import annotations

import json
import re
from enum import Enum
from typing import Callable

from deployments.output_deltas import ContentDelta, ParsedEvent, ReasoningDelta, ToolCallDelta
from deployments.chat.parsers.lexer import Marker, MarkerLexer
from deployments.chat.parsers.tool_parser import new_call_id

START, CHANNEL, CONSTRAIN, MESSAGE = "<|start|>", "<|channel|>", "<|constrain|>", "<|message|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
_MARKERS = (START, CHANNEL, CONSTRAIN, MESSAGE, END, CALL, RETURN)
_CHANNEL_NAME = re.compile(rf"{re.escape(CHANNEL)}\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"to=([^\s<]+)")


class _Body(Enum):
    REASONING = "reasoning"
    CONTENT = "content"
    CALL = "call"


class HarmonyParser:
    def __init__(self, tools_enabled: bool = True, max_calls: int | None = None,
                 new_id: Callable[[], str] = new_call_id) -> None:
        self._tools_enabled = tools_enabled
        self._max_calls = max_calls
        self._new_id = new_id
        self._lexer = MarkerLexer()
        self._header: list[str] | None = []  # text of the message header being read; None inside a body
        self._body: _Body | None = None
        self._call_name = ""
        self._call_text: list[str] = []
        self._num_calls = 0
        self._saw_message = False

    def feed(self, text: str) -> list[ParsedEvent]:
        self._lexer.feed(text)
        return self._drain()

    def finish(self, cut: bool = False) -> list[ParsedEvent]:
        """`cut`: the output ended at max_tokens, so a call body still open is unfinished (else its stop token,
        <|call|>, ended it)."""
        self._lexer.finish()
        events = self._drain()
        if self._body is _Body.CALL:
            events += self._close_call(unfinished=cut)
        elif self._header is not None and not self._saw_message:
            # No harmony markers at all (special tokens stripped?): the text is all we have.
            events.append(ContentDelta("".join(self._header)))
        return [e for e in events if not isinstance(e, (ContentDelta, ReasoningDelta)) or e.text]

    def _drain(self) -> list[ParsedEvent]:
        events: list[ParsedEvent] = []
        for token in self._lexer.tokens(lambda: _MARKERS):
            if isinstance(token, Marker):
                events += self._on_marker(token.text)
            elif self._header is not None:
                self._header.append(token.text)
            elif self._body is _Body.CALL:
                self._call_text.append(token.text)
            elif self._body is _Body.REASONING:
                events.append(ReasoningDelta(token.text))
            else:
                events.append(ContentDelta(token.text))
        return [e for e in events if not isinstance(e, (ContentDelta, ReasoningDelta)) or e.text]

    def _on_marker(self, marker: str) -> list[ParsedEvent]:
        if self._header is not None:
            if marker == MESSAGE:
                self._open_body("".join(self._header))
            elif marker in (CHANNEL, CONSTRAIN):
                self._header.append(marker)  # part of the header, read when <|message|> comes
            else:
                self._header = []
            return []
        events = self._close_call() if self._body is _Body.CALL else []
        self._body = None
        self._header = [marker] if marker == CHANNEL else []
        return events

    def _open_body(self, header: str) -> None:
        self._saw_message = True
        self._header = None
        channel = _CHANNEL_NAME.search(header)
        recipient = _RECIPIENT.search(header)
        if recipient is not None and self._tools_enabled:
            self._body = _Body.CALL
            self._call_name = recipient.group(1).removeprefix("functions.")
            self._call_text = []
        elif channel is not None and channel.group(1) == "analysis":
            self._body = _Body.REASONING
        else:
            self._body = _Body.CONTENT  # final, and commentary preambles to the user

    def _close_call(self, unfinished: bool = False) -> list[ParsedEvent]:
        text = "".join(self._call_text)
        text = text.lstrip() if unfinished else text.strip()
        self._body = None
        if self._max_calls is not None and self._num_calls >= self._max_calls:
            return []
        try:
            arguments = json.dumps(json.loads(text), ensure_ascii=False)
            unfinished = False  # whole after all
        except ValueError:
            arguments = text  # sent as the model wrote it, like any invalid arguments
        event = ToolCallDelta(self._num_calls, arguments, self._new_id(), self._call_name, unfinished)
        self._num_calls += 1
        return [event]
