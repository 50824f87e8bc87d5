"""A request for a model that loads on demand (the ingress's `on_demand` models, issue 55): its client while the
model loads. A streamed answer opens at once (the queued event, then keep-alives while the model loads, so a client
that waits is never timed out); other calls wait for the load. A load that fails answers its own error.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, AsyncIterator, Awaitable, Callable

from deployments.ingress.model_entries import ModelEntry
from deployments.model_calls import GenerateJob, StreamChunk
from engine.errors import ModelLoadError, OrchardError

# Client calls that answer a stream of events (the others are awaited).
STREAMED_CALLS = frozenset({"generate", "transcribe", "speak", "generate_images"})


class AutoLoadingClient:
    def __init__(self, entry: ModelEntry, route: Callable[[str], Awaitable[Any]]) -> None:
        self._entry = entry
        self._route = route

    async def ready(self) -> Any:
        """The model's client once its load has settled; the load's error if it failed."""
        operation = self._entry.operation
        await operation.settled.wait()
        failure = operation.failed_with
        if isinstance(failure, OrchardError):
            raise failure
        if failure is not None:
            raise ModelLoadError(f"The model '{self._entry.model_id}' did not load: {failure!r}", param="model")
        return await self._route(self._entry.model_id)

    def generate(self, job: GenerateJob) -> AsyncIterator[StreamChunk]:
        return self._generate(job)

    async def _generate(self, job: GenerateJob) -> AsyncIterator[StreamChunk]:
        if job.stream:  # the stream opens now: its keep-alives run while the model loads
            yield StreamChunk(queued=True)
        try:
            client = await self.ready()
        except OrchardError as exc:
            yield StreamChunk(error=exc)
            return
        async with contextlib.aclosing(client.generate(job)) as chunks:
            async for chunk in chunks:
                yield chunk

    def __getattr__(self, name: str) -> Any:
        if name in STREAMED_CALLS:
            return lambda *args, **kwargs: self._streamed(name, args, kwargs)
        return lambda *args, **kwargs: self._awaited(name, args, kwargs)

    async def _streamed(self, name: str, args: tuple, kwargs: dict) -> AsyncIterator[Any]:
        client = await self.ready()
        async with contextlib.aclosing(getattr(client, name)(*args, **kwargs)) as events:
            async for event in events:
                yield event

    async def _awaited(self, name: str, args: tuple, kwargs: dict) -> Any:
        client = await self.ready()
        result = getattr(client, name)(*args, **kwargs)
        return await result if inspect.isawaitable(result) else result


__all__ = ["AutoLoadingClient"]
