"""Whitespace around markers: dropped next to a marker, kept inside text, whatever the chunking."""

from __future__ import annotations


class EdgeTrim:
    """Passes text through but holds trailing whitespace until more text shows it is inner.

    `strip_leading` drops whitespace at the start (after a marker); `drop_pending()` forgets
    held whitespace (a marker follows); `flush()` releases it (the text really ended there).
    """

    def __init__(self, strip_leading: bool = False) -> None:
        self._strip_leading = strip_leading
        self._pending = ""

    def restart(self, strip_leading: bool) -> None:
        self._strip_leading = strip_leading
        self._pending = ""

    def text(self, text: str) -> str:
        if self._strip_leading:
            text = text.lstrip()
            if not text:
                return ""
            self._strip_leading = False
        body = text.rstrip()
        if not body:
            self._pending += text
            return ""
        out = self._pending + body
        self._pending = text[len(body):]
        return out

    def drop_pending(self) -> None:
        self._pending = ""

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return out
