"""ImageService: an image model (model_type image-generation or image-edit) serving /v1/images/generations or edits.

One generation thread per model (engine/images/worker.py): waiting images of one size are denoised together, up to
max_image_batch; each denoising step's progress goes back to its request as it happens, and a request whose client
goes away leaves its batch at its next step. Images are encoded off the event loop (image_io.py).
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from pathlib import Path
from typing import AsyncIterator

from deployments.config import ModelConfig
from deployments.image_calls import ImageEvent, ImageJob, ImageUsage
from deployments.images.image_io import EditInputs, edit_inputs, encoded
from deployments.model_calls import ModelInfo, QueueStats
from deployments.route_service import OneRouteService
from engine.errors import InvalidRequestError, ModelUnloadedError, OrchardError
from engine.images.families import image_family
from engine.images.worker import ImageWorker

logger = logging.getLogger("ray.serve.orchard")
# quantize left out: Bodega's 8 bits on a GPU; on the CPU the weights as stored, since MLX's CPU quantized matmuls are
# slower than plain ones (a tiny FLUX.2 model's 64x64 image: ~18 s at 8 bits, ~2 s as stored, on 2 cores)
GPU_DEFAULT_BITS = 8
GPU_MAX_BATCH = 4  # max_image_batch left out on a GPU; on the CPU 1 (its matmuls are busy with one image already)
MAX_INPUT_PIXELS = 4096 * 4096


class GenerationCancelled(Exception):
    """Raised from the step callback when the request's client has gone: the denoising loop ends there."""


class ImageService(OneRouteService):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.family = image_family(config.config_name, config.model_type)
        self.kind = "image-edit" if self.family.edits else "image-generation"
        self.route = "/v1/images/edits" if self.family.edits else "/v1/images/generations"
        self._worker: ImageWorker | None = None
        self._images_total = 0
        self._steps_total = 0
        self._step_seconds_total = 0.0

    async def start(self) -> None:
        started = time.monotonic()
        worker = ImageWorker(self._load, self._max_batch(), f"img-{self.model_id}")
        try:
            await asyncio.wrap_future(worker.loaded)
        except BaseException:
            worker.close()
            raise
        self._worker = worker
        self.created_at = int(time.time())
        logger.info("image model %s (%s) ready in %.1f s, batches of up to %d images", self.model_id,
                    self.family.name, time.monotonic() - started, self._worker.max_batch)

    def _max_batch(self) -> int:
        import mlx.core as mx

        if self.config.max_image_batch is not None:
            return self.config.max_image_batch
        return GPU_MAX_BATCH if mx.default_device() == mx.gpu else 1

    def _load(self):
        from engine.images.generator import ImageGenerator

        import mlx.core as mx

        from engine.images.generator import free_memory_bytes
        from engine.images.memory import check_fits

        bits = self.config.quantize
        if bits is None:
            bits = GPU_DEFAULT_BITS if mx.default_device() == mx.gpu else None
        folder = Path(self.config.model_path)
        check_fits(self.model_id, folder, bits, free_memory_bytes())
        return ImageGenerator(folder, self.family, quantize=bits, lora_paths=self.config.lora_paths,
                              lora_scales=self.config.lora_scales)

    async def generate_images(self, job: ImageJob) -> AsyncIterator[ImageEvent]:
        try:
            self._checked(job)
            kept = (await asyncio.to_thread(edit_inputs, job.images, job.mask, MAX_INPUT_PIXELS)
                    if self.family.edits else None)
        except OrchardError as exc:
            yield ImageEvent(error=exc)
            return
        seed = job.seed if job.seed is not None else random.randrange(2**31)
        steps = job.steps or self.family.default_steps
        cancelled = threading.Event()
        self._active += 1
        try:
            async for event in self._images(job, seed, steps, kept, cancelled):
                yield event
            yield ImageEvent(done=True, usage=ImageUsage(len(job.prompt.split()), steps * job.n))
        except OrchardError as exc:
            yield ImageEvent(error=exc)
        except Exception as exc:  # the model's own failure: the request ends with it, the service serves on
            logger.exception("image model %s failed", self.model_id)
            yield ImageEvent(error=OrchardError(f"image generation failed: {exc!r}"[:500]))
        finally:
            cancelled.set()  # a client gone mid-image: its next step ends the generation
            self._active -= 1

    def _checked(self, job: ImageJob) -> None:
        if self._unloading or self._worker is None:
            raise ModelUnloadedError(f"The model '{self.model_id}' is not serving", param="model")
        if job.n > self.config.max_images_per_request:
            raise InvalidRequestError(f"'n' is {job.n}; this model makes at most {self.config.max_images_per_request}"
                                      " images a request (max_images_per_request)", param="n")
        if not self.family.edits:
            if job.images:
                raise InvalidRequestError(f"The model '{self.model_id}' generates images from text: send the image to "
                                          "edit to an image-edit model (POST /v1/images/edits)", param="model")
        elif len(job.images) > self.family.max_input_images:
            raise InvalidRequestError(f"{len(job.images)} images: {self.family.name} edits with at most "
                                      f"{self.family.max_input_images}", param="image")

    async def _images(self, job: ImageJob, seed: int, steps: int, kept: EditInputs | None,
                      cancelled: threading.Event) -> AsyncIterator[ImageEvent]:
        """The request's n images, submitted at once (they can share a batch): each step's progress, then each
        encoded image as it is made."""
        from engine.images.generator import ImageSpec

        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        guidance = job.guidance if job.guidance is not None else self.family.default_guidance
        started = time.monotonic()
        made = [self._worker.submit(ImageSpec(job.prompt, job.width, job.height, steps, guidance, seed + index,
                                              job.images), self._progress(index, events, loop, cancelled))
                for index in range(job.n)]
        for index, future in enumerate(made):
            # Each end wakes the loop below with its index; a failure is read there (or dropped: a client gone)
            asyncio.wrap_future(future).add_done_callback(
                lambda done, index=index: (done.cancelled() or done.exception(), events.put_nowait(index)))
        try:
            for _ in range(job.n):
                while not isinstance(event := await events.get(), int):
                    yield event
                image = await asyncio.to_thread(encoded, made[event].result(), job.output_format,
                                                job.output_compression, kept)
                self._images_total += 1
                yield ImageEvent(index=event, step=steps, steps=steps, image=image, seed=seed + event)
        finally:
            for future in made:
                future.cancel()  # one not started never will be (one started ends at its next step)
        self._steps_total += steps * job.n
        self._step_seconds_total += time.monotonic() - started

    @staticmethod
    def _progress(index: int, events: asyncio.Queue, loop: asyncio.AbstractEventLoop, cancelled: threading.Event):
        """Image `index`'s step callback (on the generation thread): its progress event, or the end if the
        request's client has gone."""
        def on_step(done: int, total: int) -> None:
            if cancelled.is_set():
                raise GenerationCancelled(f"the client of image {index} went away at step {done} of {total}")
            loop.call_soon_threadsafe(events.put_nowait, ImageEvent(index=index, step=done, steps=total))

        return on_step

    def info(self) -> ModelInfo:
        return self._info(self.config.model_path, 0)

    def queue_stats(self) -> QueueStats:
        return QueueStats(
            model_id=self.model_id, waiting=0, running=self._active, decoding=self._active, max_num_seqs=1,
            queue_size=None, kv_cache_bytes=0, prompt_tokens_total=0, generation_tokens_total=self._images_total,
            tokens_per_s=0.0, steps_total=self._steps_total, step_seconds_total=round(self._step_seconds_total, 4),
            step_cpu_seconds_total=0.0, process_cpu_seconds_total=round(time.process_time(), 4),
        )

    async def shutdown(self) -> None:
        await super().shutdown()
        if self._worker is not None:
            self._worker.close()


__all__ = ["GenerationCancelled", "ImageService"]
