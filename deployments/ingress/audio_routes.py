"""POST /v1/audio/transcriptions and /v1/audio/translations: OpenAI's speech-to-text routes, answered by a model
of model_type stt. The multipart form is read here (the body limit applies first); the file is decoded on the
model's side. `stream: true` answers transcript.text.delta events as the text decodes, then transcript.text.done."""

from __future__ import annotations

import contextlib
import logging
from pathlib import PurePath
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from starlette.datastructures import UploadFile

from deployments.api.audio_schemas import TranscriptionForm, delta_event, done_event, rendered, transcription_form
from deployments.api.errors import wire_error
from deployments.api.openapi_errors import EVENT_STREAM, GENERATION, error_responses
from deployments.api.sse import SSE_HEADERS, SSE_KEEPALIVE, sse_event
from deployments.ingress.edge import REQUEST_ID
from deployments.ingress.generation import KEEPALIVE_S, ChunkReader
from deployments.ingress.model_registry import Registry
from deployments.metrics.ingress_metrics import Api, IngressMetrics, RequestOutcome
from deployments.speech_calls import Transcript, TranscriptEvent
from engine.errors import InvalidRequestError

logger = logging.getLogger("ray.serve.orchard")
_FORM = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["file", "model"],
    "properties": {"file": {"type": "string", "format": "binary"}, "model": {"type": "string"},
                   "language": {"type": "string"}, "prompt": {"type": "string"},
                   "response_format": {"type": "string"}, "temperature": {"type": "number"},
                   "stream": {"type": "boolean"}}}}}}}


def audio_router(registry: Registry, metrics: IngressMetrics, keepalive_s: float = KEEPALIVE_S) -> APIRouter:
    router = APIRouter()

    async def answer(request: Request, task: str) -> Response:
        form = await _read_form(request, task)
        client = await registry.route(form.model)
        tally = metrics.request(Api.AUDIO, form.model)
        job = form.job(REQUEST_ID.get())
        logger.info("%s with model %s: %d bytes of %s, format %s, stream=%s [X-Request-Id %s]", task, form.model,
                    len(form.audio), form.filename, form.response_format, form.stream, job.log_id)
        events = client.transcribe(job)
        if form.stream:
            return StreamingResponse(_streamed(events, tally, keepalive_s), media_type="text/event-stream",
                                     headers=SSE_HEADERS)
        transcript = await _whole(events, tally)
        body, media_type = rendered(transcript, form)
        return Response(body, media_type=media_type)

    @router.post("/v1/audio/transcriptions", responses={**EVENT_STREAM, **error_responses(GENERATION)},
                 openapi_extra=_FORM)
    async def transcriptions(request: Request) -> Response:
        return await answer(request, "transcribe")

    @router.post("/v1/audio/translations", responses=error_responses(GENERATION), openapi_extra=_FORM)
    async def translations(request: Request) -> Response:
        return await answer(request, "translate")

    return router


async def _read_form(request: Request, task: str) -> TranscriptionForm:
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise InvalidRequestError("send the audio as multipart/form-data, in the field 'file'", param="file")
    try:
        form = await request.form(max_files=1, max_fields=32)
    except Exception as exc:  # starlette's MultiPartException on a malformed or oversized form
        raise InvalidRequestError(f"malformed multipart body: {getattr(exc, 'detail', exc)}", param="file") from exc
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(form.close)
        fields: dict[str, list[Any]] = {}
        for name, value in form.multi_items():
            fields.setdefault(name, []).append(value)
        upload = (fields.pop("file", None) or [None])[-1]
        if not isinstance(upload, UploadFile):
            raise InvalidRequestError("send the audio file in the multipart field 'file'", param="file")
        parsed = transcription_form(fields, task)
        if parsed.ignored:
            logger.info("audio request: ignored form fields %s", ", ".join(parsed.ignored))
        parsed.audio = await upload.read()
        parsed.filename = PurePath((upload.filename or "").replace("\\", "/")).name or "audio"
        if not parsed.audio:
            raise InvalidRequestError("'file' is empty", param="file")
        return parsed


async def _whole(events: AsyncIterator[TranscriptEvent], tally) -> Transcript:
    async with contextlib.aclosing(events) as stream:
        try:
            async for event in stream:
                if event.error is not None:
                    tally.end(RequestOutcome.ERROR)
                    raise event.error
                if event.transcript is not None:
                    tally.end(RequestOutcome.FINISHED)
                    return event.transcript
        except BaseException as exc:
            tally.end_by_exception(exc)
            raise
    tally.end(RequestOutcome.ERROR)
    raise InvalidRequestError("the model ended the transcription without a transcript")


async def _streamed(events: AsyncIterator[TranscriptEvent], tally, keepalive_s: float) -> AsyncIterator[str]:
    """SSE: a delta per decoded piece of text, then the done event; a keep-alive comment while the audio encodes;
    an error as OpenAI streams one (data: {"error": ...})."""
    reader = ChunkReader(events)  # a read that times out stays pending for the next one
    try:
        while True:
            try:
                event = await reader.next(keepalive_s)
            except StopAsyncIteration:
                tally.end(RequestOutcome.ERROR)
                return
            if event is None:
                yield SSE_KEEPALIVE
            elif event.error is not None:
                tally.end(RequestOutcome.ERROR)
                yield sse_event(wire_error(event.error).body)
                return
            elif event.transcript is not None:
                tally.end(RequestOutcome.FINISHED)
                yield sse_event(done_event(event.transcript))
                return
            elif event.delta:
                yield sse_event(delta_event(event.delta))
    finally:
        tally.end(RequestOutcome.ABORTED)  # counted once: a stream that ended above keeps its outcome
        await reader.aclose()
