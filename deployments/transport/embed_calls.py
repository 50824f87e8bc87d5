"""EmbedCalls: concurrent embedding requests to one model ride few Ray handle calls.

Each handle call costs the ingress more CPU than encoding one sentence costs the model (Ray's router and call path),
so under a burst the ingress, not the model, was the bound. A request goes at once while fewer than
`max_in_flight` calls are out (a lone request waits for nothing); requests arriving meanwhile wait for the next
free call and go in it together. The replica's EmbedBatcher then encodes what arrives together in one forward.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Awaitable, Callable

from deployments.model_calls import EmbedJob, EmbedResult

SendJobs = Callable[[list[EmbedJob]], Awaitable[list[EmbedResult]]]
# Two calls out: the model encodes one batch while the next one travels.
MAX_IN_FLIGHT = 2
MAX_JOBS_PER_CALL = 256


@dataclass
class _WaitingJob:
    job: EmbedJob
    result: asyncio.Future


class EmbedCalls:
    def __init__(self, send: SendJobs, max_in_flight: int = MAX_IN_FLIGHT, max_jobs: int = MAX_JOBS_PER_CALL) -> None:
        self._send = send
        self._max_in_flight = max_in_flight
        self._max_jobs = max_jobs
        self._waiting: list[_WaitingJob] = []
        self._calls: set[asyncio.Task] = set()  # referenced until done (the loop keeps only weak references)

    async def embed(self, job: EmbedJob) -> EmbedResult:
        waiting = _WaitingJob(job, asyncio.get_running_loop().create_future())
        self._waiting.append(waiting)
        self._dispatch()
        return await waiting.result

    def _dispatch(self) -> None:
        while self._waiting and len(self._calls) < self._max_in_flight:
            batch, self._waiting = self._waiting[: self._max_jobs], self._waiting[self._max_jobs :]
            batch = [w for w in batch if not w.result.done()]  # a request cancelled while waiting goes nowhere
            if not batch:
                continue
            call = asyncio.create_task(self._call(batch))
            self._calls.add(call)
            call.add_done_callback(self._call_done)

    async def _call(self, batch: list[_WaitingJob]) -> None:
        try:
            results = await self._send([w.job for w in batch])
        except BaseException as exc:  # cancelled (the server stopping), or the send failed: its waiters are told
            for w in batch:
                if w.result.done():
                    continue
                if isinstance(exc, asyncio.CancelledError):
                    w.result.cancel()
                else:
                    w.result.set_exception(exc)
            raise
        for w, result in zip(batch, results, strict=True):
            if not w.result.done():
                w.result.set_result(result)

    def _call_done(self, call: asyncio.Task) -> None:
        self._calls.discard(call)
        if not call.cancelled():
            call.exception()  # retrieved: the waiters were told
        self._dispatch()
