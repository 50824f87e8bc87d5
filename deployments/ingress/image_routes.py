"""POST /v1/images/generations (JSON) and /v1/images/edits (multipart: image or image[], mask, the fields): OpenAI's
image routes, answered by a model of model_type image-generation or image-edit.

Not streamed: the answer comes when every image is made (OpenAI's ImagesResponse, b64_json). `stream: true`: SSE, a
comment line per denoising step (`: image 1 of 2, step 3 of 4`, the progress curl shows and SDKs skip), then each
image's image_generation.completed (image_edit.completed) event as it is made.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.datastructures import UploadFile

from deployments.api.errors import wire_error
from deployments.api.image_schemas import ImageRequest, completed_event, images_body
from deployments.api.openapi_errors import EVENT_STREAM, GENERATION, error_responses
from deployments.api.sse import SSE_HEADERS, SSE_KEEPALIVE, sse_event
from deployments.image_calls import ImageEvent, ImageJob, ImageUsage
from deployments.ingress.edge import REQUEST_ID
from deployments.ingress.generation import KEEPALIVE_S, ChunkReader
from deployments.ingress.model_registry import Registry
from deployments.metrics.ingress_metrics import Api, IngressMetrics, RequestOutcome, RequestTally
from engine.errors import InvalidRequestError

logger = logging.getLogger("ray.serve.orchard")
MAX_EDIT_IMAGES = 16
_EDIT_FORM = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["image", "prompt", "model"],
    "properties": {"image": {"type": "string", "format": "binary"}, "mask": {"type": "string", "format": "binary"},
                   "prompt": {"type": "string"}, "model": {"type": "string"}, "n": {"type": "integer"},
                   "size": {"type": "string"}, "output_format": {"type": "string"},
                   "stream": {"type": "boolean"}}}}}}}


def image_router(registry: Registry, metrics: IngressMetrics, keepalive_s: float = KEEPALIVE_S) -> APIRouter:
    router = APIRouter()

    async def answer(request: ImageRequest, job: ImageJob, kind: str) -> Response:
        client = await registry.route(request.model)
        tally = metrics.request(Api.IMAGES, request.model)
        if request.ignored:
            logger.info("image request: %s accepted and not used", ", ".join(request.ignored))
        logger.info("%s with model %s: n=%d, %dx%d, %d input images, stream=%s [X-Request-Id %s]", kind,
                    request.model, job.n, job.width, job.height, len(job.images), request.stream, job.log_id)
        reader = ChunkReader(client.generate_images(job))
        first = await _first_event(reader, tally)
        if request.stream:
            return StreamingResponse(_streamed(first, reader, tally, request, kind, keepalive_s),
                                     media_type="text/event-stream", headers=SSE_HEADERS)
        images, usage = await _whole(first, reader, tally)
        return JSONResponse(images_body(request, images, usage))

    @router.post("/v1/images/generations", responses={**EVENT_STREAM, **error_responses(GENERATION)})
    async def generations(body: ImageRequest) -> Response:
        return await answer(body, body.job(REQUEST_ID.get()), "image_generation")

    @router.post("/v1/images/edits", responses={**EVENT_STREAM, **error_responses(GENERATION)},
                 openapi_extra=_EDIT_FORM)
    async def edits(request: Request) -> Response:
        body, images, mask = await _read_edit_form(request)
        job = body.job(REQUEST_ID.get())
        job.images, job.mask = images, mask
        return await answer(body, job, "image_edit")

    return router


async def _read_edit_form(request: Request) -> tuple[ImageRequest, list[bytes], bytes | None]:
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise InvalidRequestError("send the edit as multipart/form-data: the image in 'image', the prompt beside it",
                                  param="image")
    try:
        form = await request.form(max_files=MAX_EDIT_IMAGES + 1, max_fields=64)
    except Exception as exc:  # starlette's MultiPartException on a malformed or oversized form
        raise InvalidRequestError(f"malformed multipart body: {getattr(exc, 'detail', exc)}", param="image") from exc
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(form.close)
        fields: dict[str, Any] = {}
        images: list[bytes] = []
        mask: bytes | None = None
        for name, value in form.multi_items():
            if isinstance(value, UploadFile):
                if name in ("image", "image[]"):
                    images.append(await value.read())
                elif name == "mask":
                    mask = await value.read()
                else:
                    raise InvalidRequestError(f"'{name[:64]}' is a file; only 'image' and 'mask' are", param=name)
            else:
                fields[name] = value
        if not images or not all(images):
            raise InvalidRequestError("An edit needs 'image': the image (or images, image[]) to edit", param="image")
        try:
            body = ImageRequest.model_validate(fields)
        except ValidationError as exc:  # answered as a JSON body's would be (routes.py's handler)
            raise RequestValidationError(exc.errors()) from None
        return body, images, mask


async def _first_event(reader: ChunkReader, tally: RequestTally) -> ImageEvent | None:
    """The first event (a refusal before any work is answered with its own status)."""
    try:
        event = await reader.next(None)
    except StopAsyncIteration:
        return None
    except BaseException as exc:
        tally.end_by_exception(exc)
        await reader.aclose()
        raise
    if event is not None and event.error is not None:
        tally.end(RequestOutcome.ERROR)
        await reader.aclose()
        raise event.error
    return event


async def _whole(first: ImageEvent | None, reader: ChunkReader, tally: RequestTally) -> tuple[list[bytes], ImageUsage]:
    images: list[bytes] = []
    try:
        event = first
        while event is not None:
            if event.error is not None:
                tally.end(RequestOutcome.ERROR)
                raise event.error
            if event.image is not None:
                images.append(event.image)
            if event.done:
                tally.end(RequestOutcome.FINISHED)
                return images, event.usage or ImageUsage()
            try:
                event = await reader.next(None)
            except StopAsyncIteration:
                break
    except BaseException as exc:
        tally.end_by_exception(exc)
        raise
    finally:
        await reader.aclose()
    tally.end(RequestOutcome.ERROR)
    raise InvalidRequestError("the model ended without its images")


async def _streamed(first: ImageEvent | None, reader: ChunkReader, tally: RequestTally, request: ImageRequest,
                    kind: str, keepalive_s: float) -> AsyncIterator[str]:
    event = first
    try:
        while True:
            if event is None:
                yield SSE_KEEPALIVE
            elif event.error is not None:
                tally.end(RequestOutcome.ERROR)
                yield sse_event(wire_error(event.error).body)
                return
            elif event.image is not None:
                usage = ImageUsage(len(request.prompt.split()), event.steps)
                yield sse_event(completed_event(kind, request, event.image, usage))
            elif event.done:
                tally.end(RequestOutcome.FINISHED)
                return
            elif event.steps:
                yield f": image {event.index + 1} of {request.n}, step {event.step} of {event.steps}\n\n"
            try:
                event = await reader.next(keepalive_s)
            except StopAsyncIteration:
                tally.end(RequestOutcome.ERROR)
                return
    finally:
        tally.end(RequestOutcome.ABORTED)  # counted once: a stream that ended above keeps its outcome
        await reader.aclose()


__all__ = ["image_router"]
