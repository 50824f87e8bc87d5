"""An image model's one generation thread: waiting images of one size are taken together, up to max_batch, and
denoised as one batch (batch.py); edits go one at a time (the editor's reference images make every row its own).

The model loads on that thread too. submit() returns a concurrent Future of the PIL image. A task cancelled before it starts is skipped; one whose step
callback raises leaves its batch at that step, its future failing with what the callback raised.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

from engine.device_memory import release_thread_streams
from engine.images.batch import BatchRow, batch_key, generate_batch
from engine.images.generator import ImageGenerator, ImageSpec, OnStep


@dataclass
class ImageTask:
    spec: ImageSpec
    on_step: OnStep | None
    future: Future = field(default_factory=Future)


@dataclass
class WorkerStats:
    batches: int = 0
    images: int = 0
    largest_batch: int = 0


class ImageWorker:
    def __init__(self, load: Callable[[], ImageGenerator], max_batch: int, name: str = "images") -> None:
        """`load` runs on the worker's thread first (MLX's streams belong to the thread that made a model's
        arrays); `loaded` is its future: the generator, or what the load raised."""
        self.generator: ImageGenerator | None = None
        self.loaded: Future = Future()
        self.max_batch = max(1, max_batch)
        self.stats = WorkerStats()
        self._waiting: list[ImageTask] = []
        self._ready = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, args=(load,), name=name[:15], daemon=True)
        self._thread.start()

    def submit(self, spec: ImageSpec, on_step: OnStep | None = None) -> Future:
        task = ImageTask(spec, on_step)
        with self._ready:
            if self._closed:
                raise RuntimeError("the image worker is closed")
            self._waiting.append(task)
            self._ready.notify()
        return task.future

    def close(self) -> None:
        with self._ready:
            self._closed = True
            self._ready.notify()

    def _run(self, load: Callable[[], ImageGenerator]) -> None:
        try:
            self.generator = load()
        except BaseException as exc:  # noqa: BLE001 — the load's failure is the service's to report
            self.loaded.set_exception(exc)
            return
        self.loaded.set_result(self.generator)
        try:
            while (batch := self._take()) is not None:
                self._serve(batch)
        finally:
            with self._ready:  # closed: what still waits is cancelled
                for task in self._waiting:
                    task.future.cancel()
                self._waiting.clear()
            release_thread_streams()

    def _take(self) -> list[ImageTask] | None:
        """The oldest waiting task and those like it (its batch key), started; None once closed."""
        with self._ready:
            while True:
                while not self._waiting and not self._closed:
                    self._ready.wait()
                if self._closed:
                    return None
                first = self._waiting[0]
                alike = self.max_batch if not self.generator.family.edits else 1
                batch = [t for t in self._waiting if batch_key(t.spec) == batch_key(first.spec)][:alike]
                self._waiting = [t for t in self._waiting if t not in batch]
                started = [t for t in batch if t.future.set_running_or_notify_cancel()]
                if started:
                    return started

    def _serve(self, batch: list[ImageTask]) -> None:
        self.stats.batches += 1
        self.stats.images += len(batch)
        self.stats.largest_batch = max(self.stats.largest_batch, len(batch))
        try:
            if self.generator.family.edits:
                (task,) = batch
                task.future.set_result(self.generator.generate(task.spec, task.on_step))
                return
            rows = [BatchRow(task.spec, task.on_step) for task in batch]
            for task, row, image in zip(batch, rows, generate_batch(self.generator.model, rows)):
                if image is None:
                    task.future.set_exception(row.failure or RuntimeError("the image left its batch"))
                else:
                    task.future.set_result(image)
        except BaseException as exc:  # noqa: BLE001 — the model's failure belongs to the batch's requests
            for task in batch:
                if not task.future.done():
                    task.future.set_exception(exc)


__all__ = ["ImageTask", "ImageWorker", "WorkerStats"]
