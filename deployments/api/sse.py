"""Server-sent events framing as OpenAI and Anthropic stream them."""

from __future__ import annotations

import json
from typing import Any

SSE_DONE = "data: [DONE]\n\n"
SSE_KEEPALIVE = ": keep-alive\n\n"  # an SSE comment: clients ignore it, idle timeouts see bytes
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def sse_events(payloads: list[dict[str, Any]]) -> str:
    """Several events in one write: one network (and Ray) message per coalesced chunk."""
    return "".join(sse_event(p) for p in payloads)


def named_sse_events(events: list[tuple[str, dict[str, Any]]]) -> str:
    """Anthropic's framing: every event has its name on an `event:` line; no [DONE] at the end."""
    return "".join(
        f"event: {name}\ndata: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"
        for name, payload in events
    )
