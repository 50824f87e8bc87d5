"""StreamRouter: the asyncio side's mailbox per request id, a step's outputs routed to them in one call;
RequestStream: one request's outputs as an async iterator."""

from __future__ import annotations

from typing import AsyncIterator, Callable

from engine.errors import InvalidRequestError, OrchardError
from engine.output.events import Finish, RequestOutput, TextDelta
from engine.output.mailbox import Mailbox


class StreamRouter:
    def __init__(self) -> None:
        self._mailboxes: dict[str, Mailbox] = {}

    def open(self, request_id: str) -> Mailbox:
        if request_id in self._mailboxes:
            raise InvalidRequestError(f"Duplicate request id '{request_id}'", param="request_id")
        mailbox = self._mailboxes[request_id] = Mailbox()
        return mailbox

    def get(self, request_id: str) -> Mailbox | None:
        return self._mailboxes.get(request_id)

    def pop(self, request_id: str) -> Mailbox | None:
        return self._mailboxes.pop(request_id, None)

    def deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            mailbox = self._mailboxes.get(output.request_id)
            if mailbox is None:
                continue
            mailbox.put(output)
            if output.finished:
                del self._mailboxes[output.request_id]

    def fail_all(self, error: OrchardError) -> None:
        for mailbox in self._mailboxes.values():
            mailbox.put_error(error)
        self._mailboxes.clear()


class RequestStream:
    """Async iterator of TextDelta items then one Finish; raises the request's OrchardError.

    Closing it early (client gone) aborts the request through `abort`.
    """

    def __init__(self, request_id: str, mailbox: Mailbox, abort: Callable[[str], None]) -> None:
        self.request_id = request_id
        self._mailbox = mailbox
        self._abort = abort

    def __aiter__(self) -> AsyncIterator[TextDelta | Finish]:
        return self._iterate()

    async def hold(self, timeout_s: float | None) -> None:
        """Wait until the request ends or timeout_s passes, taking nothing: meanwhile the engine's
        deltas merge in the mailbox, so a consumer that holds between reads wakes once, not per token."""
        await self._mailbox.wait_end(timeout_s)

    async def _iterate(self) -> AsyncIterator[TextDelta | Finish]:
        try:
            while not self._mailbox.closed:
                yield await self._mailbox.take()
        finally:
            if not self._mailbox.closed:
                self._abort(self.request_id)
