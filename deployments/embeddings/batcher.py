"""Dynamic batching of concurrent embedding requests: texts that arrive while the model waits a few ms (or
encodes the previous batch) are encoded together in one call, then split back per request.

Plain asyncio (no Serve), so the in-process stack batches as the Serve replica does.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Callable

import numpy as np

EncodeTexts = Callable[[list[str]], np.ndarray]


@dataclass
class PendingTexts:
    texts: list[str]
    result: asyncio.Future


class EmbedBatcher:
    def __init__(self, encode: EncodeTexts, executor: Executor, wait_s: float, max_texts: int) -> None:
        self._encode = encode
        self._executor = executor
        self._wait_s = wait_s
        self._max_texts = max_texts
        self._pending: list[PendingTexts] = []
        self._wake = asyncio.Event()
        self._worker: asyncio.Task | None = None
        self.texts_waiting = 0
        self.texts_encoding = 0
        self.batches_total = 0  # encode calls: fewer than requests under load
        self.encode_seconds_total = 0.0

    async def embed(self, texts: list[str]) -> np.ndarray:
        """One row per text, encoded together with whatever other requests are waiting."""
        if not texts:
            return np.zeros((0, 0), dtype=np.float32)
        if self._worker is None:
            self._worker = asyncio.create_task(self._run())
        pending = PendingTexts(texts, asyncio.get_running_loop().create_future())
        self._pending.append(pending)
        self.texts_waiting += len(texts)
        self._wake.set()
        return await pending.result

    async def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
        for pending in self._pending:
            if not pending.result.done():
                pending.result.cancel()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            if self.texts_waiting < self._max_texts and self._wait_s > 0:
                await asyncio.sleep(self._wait_s)  # let a burst's other requests join this batch
            batch = self._take_batch()
            if not self._pending:
                self._wake.clear()
            if batch:
                await self._encode_batch(batch)

    def _take_batch(self) -> list[PendingTexts]:
        """Waiting requests in arrival order, up to max_texts texts (a larger single request goes alone)."""
        batch: list[PendingTexts] = []
        count = 0
        while self._pending and (not batch or count + len(self._pending[0].texts) <= self._max_texts):
            pending = self._pending.pop(0)
            self.texts_waiting -= len(pending.texts)
            if pending.result.done():  # the client went away while it waited
                continue
            batch.append(pending)
            count += len(pending.texts)
        return batch

    async def _encode_batch(self, batch: list[PendingTexts]) -> None:
        texts = [text for pending in batch for text in pending.texts]
        self.texts_encoding = len(texts)
        self.batches_total += 1
        started = time.monotonic()
        try:
            vectors = await asyncio.get_running_loop().run_in_executor(self._executor, self._encode, texts)
        except Exception as exc:  # every request of the batch learns why
            for pending in batch:
                if not pending.result.done():
                    pending.result.set_exception(exc)
            return
        finally:
            self.texts_encoding = 0
            self.encode_seconds_total += time.monotonic() - started
        start = 0
        for pending in batch:
            end = start + len(pending.texts)
            if not pending.result.done():
                pending.result.set_result(vectors[start:end])
            start = end
