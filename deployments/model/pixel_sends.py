"""A repeated image's pixels stay in the replica: the engine keeps each image's features (the vision tower's output,
engine/vision/feature_cache.py), so a request whose images were all processed lately (chat/processed_images.py)
goes without its pixels (10.8 MB for one 672x672 image in float32, pickled to the engine process). An engine that
no longer keeps them (evicted, or a restarted engine) refuses it at once, before any output
(ImagePixelsNeededError), and it goes again with them; one that can keep none says so, and pixels then always go.
"""

from __future__ import annotations

import logging
from typing import AsyncIterator, Callable, Protocol

from engine.client.interface import RetriedStream, StreamEvent
from engine.errors import ImagePixelsNeededError, OrchardError
from engine.request import Request
from engine.vision.inputs import VisionInputs

logger = logging.getLogger(__name__)


class EventStream(Protocol):
    """A request's stream as engine clients return it (RequestStream, the supervisor's ResubmittingStream)."""

    def __aiter__(self) -> AsyncIterator[StreamEvent]: ...

    async def hold(self, timeout_s: float | None) -> None: ...


Submit = Callable[[Request], EventStream]


class PixelSends:
    def __init__(self) -> None:
        self.leave_out = True  # until the engine says it keeps no features it could merge without the pixels

    def vision_to_send(self, vision: VisionInputs | None, images_repeated: bool) -> VisionInputs | None:
        if vision is None or not images_repeated or not self.leave_out:
            return vision
        return vision.without_pixels()

    def submit(self, submit: Submit, request: Request, vision: VisionInputs | None) -> EventStream:
        """`request`'s stream from `submit`; one that went without the pixels of `vision` goes again with them
        where the engine asks."""
        stream = submit(request)
        if request.vision is vision or vision is None:
            return stream
        return PixelsOnDemandStream(self, submit, request, vision, stream)


class PixelsOnDemandStream(RetriedStream):
    """A request's stream that, refused for lack of its pixels before any output, goes again with them."""

    retried_on = ImagePixelsNeededError

    def __init__(self, sends: PixelSends, submit: Submit, request: Request, vision: VisionInputs,
                 stream: EventStream) -> None:
        super().__init__(request.request_id, stream)
        self._sends, self._submit, self._request, self._vision = sends, submit, request, vision

    async def again(self, error: OrchardError) -> EventStream:
        if isinstance(error, ImagePixelsNeededError) and error.never_kept:
            self._sends.leave_out = False
        logger.info("request %s sent again with its images' pixels: %s", self.request_id, error.message)
        again = self._request.as_submitted()
        again.vision = self._vision
        return self._submit(again)


__all__ = ["PixelSends", "PixelsOnDemandStream"]
