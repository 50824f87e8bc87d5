"""ASGI middlewares at the ingress's edge, before FastAPI: request ids, the body size limit, early error answers."""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse

from deployments.api.errors import RequestTooLargeError, wire_error, wire_error_for_path
from engine.errors import InvalidRequestError, OrchardError
from engine.request import Priority

logger = logging.getLogger("ray.serve.orchard")
REQUEST_ID: ContextVar[str] = ContextVar("orchard_request_id", default="-")
# X-Orchard-Priority: "batch" lowers a request's scheduling class (a client may lower its own, none may raise it).
REQUEST_PRIORITY: ContextVar[Priority] = ContextVar("orchard_request_priority", default=Priority.INTERACTIVE)
PRIORITY_HEADER = "X-Orchard-Priority"
_PRIORITIES = {"interactive": Priority.INTERACTIVE, "batch": Priority.BATCH}
_SAFE_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


async def send_error(scope: dict, receive: Callable, send: Callable, exc: OrchardError) -> None:
    """Answer with the error, mapped as the routes' errors are, in the shape of the path's API."""
    logger.info("%s %s -> %s: %s [request %s]", scope["method"], scope["path"], exc.code, exc.message, REQUEST_ID.get())
    error = wire_error_for_path(scope["path"], wire_error(exc))
    await JSONResponse(error.body, status_code=error.status, headers=error.headers)(scope, receive, send)


class RequestIdMiddleware:
    """Every request gets an id for its log lines: the caller's X-Request-Id, or a new one echoed back; and its
    scheduling class (X-Orchard-Priority: interactive, the default, or batch; another value is refused).

    Under Serve the proxy has already set (and will echo) the header, so only the id is read.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        incoming = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        given = bool(_SAFE_REQUEST_ID.match(incoming))
        request_id = incoming if given else uuid.uuid4().hex

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start" and not given:
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
            await send(message)

        token = REQUEST_ID.set(request_id)
        try:
            try:
                priority = _asked_priority(scope)
            except InvalidRequestError as exc:
                await send_error(scope, receive, send_with_id, exc)
                return
            priority_token = REQUEST_PRIORITY.set(priority)
            try:
                await self.app(scope, receive, send_with_id)
            finally:
                REQUEST_PRIORITY.reset(priority_token)
        finally:
            REQUEST_ID.reset(token)


def _asked_priority(scope: dict) -> Priority:
    asked = dict(scope["headers"]).get(PRIORITY_HEADER.lower().encode())
    if asked is None:
        return Priority.INTERACTIVE
    text = asked.decode("latin-1")
    priority = _PRIORITIES.get(text.strip().lower())
    if priority is None:
        raise InvalidRequestError(f"{PRIORITY_HEADER} is 'interactive' or 'batch', not {text[:40]!r}",
                                  param=PRIORITY_HEADER)
    return priority


@dataclass
class _BodyCount:
    received: int = 0
    refused: bool = False
    response_started: bool = False


class BodyLimitMiddleware:
    """Refuses bodies over `max_body_bytes` with 413: a larger Content-Length before any byte is read, a body of
    unknown length (chunked) as soon as what arrived passes the limit. The app then sees a disconnect and its own
    answer is dropped."""

    def __init__(self, app: Any, max_body_bytes: int, path_limits: dict[str, int] | None = None) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.path_limits = path_limits or {}  # routes with a limit of their own (RAG uploads)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.path_limits.get(scope["path"], self.max_body_bytes)
        declared = _content_length(scope["headers"])
        if declared is not None and declared > limit:
            await send_error(scope, receive, send, self._too_large(limit))
            return
        count = _BodyCount()

        async def counting_receive() -> dict:
            if count.refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                count.received += len(message.get("body", b""))
                if count.received > limit:
                    count.refused = True
                    if not count.response_started:
                        await send_error(scope, receive, send, self._too_large(limit))
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: dict) -> None:
            if count.refused:
                return  # the 413 is the answer
            if message["type"] == "http.response.start":
                count.response_started = True
            await send(message)

        await self.app(scope, counting_receive, guarded_send)

    def _too_large(self, limit: int) -> RequestTooLargeError:
        return RequestTooLargeError(f"The request body is larger than the limit of {limit} bytes")


def _content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    for name, value in headers:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the HTTP server refuses a malformed length; count the body instead
    return None
