"""POST /v1/audio/speech: OpenAI's text-to-speech route, answered by a model of model_type tts.

The answer waits for the first sentence's audio (or the request's error, answered with its status), then streams:
the encoded audio as the body (stream_format audio, chunked), or speech.audio.delta events and speech.audio.done
(stream_format sse). A failure after the first bytes ends the body early, so a client cannot mistake it for the whole.
"""

from __future__ import annotations

import contextlib
import logging
from typing import AsyncIterator

from fastapi import APIRouter
from fastapi.responses import Response, StreamingResponse

from deployments.api.errors import wire_error
from deployments.api.openapi_errors import EVENT_STREAM, GENERATION, error_responses
from deployments.api.speech_schemas import SpeechRequest, audio_delta_event, audio_done_event
from deployments.api.sse import SSE_HEADERS, SSE_KEEPALIVE, sse_event
from deployments.ingress.edge import REQUEST_ID
from deployments.ingress.generation import KEEPALIVE_S, ChunkReader
from deployments.ingress.model_registry import Registry
from deployments.metrics.ingress_metrics import Api, IngressMetrics, RequestOutcome, RequestTally
from deployments.speech.audio_out import MEDIA_TYPES
from deployments.speech_calls import SpeechAudioEvent
from engine.errors import OrchardError

logger = logging.getLogger("ray.serve.orchard")


class SpeechStreamBroken(Exception):
    """The model failed after the answer's first bytes: raised into the body so the connection ends unfinished."""


def speech_router(registry: Registry, metrics: IngressMetrics, keepalive_s: float = KEEPALIVE_S) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/audio/speech", responses={200: {"content": {t: {} for t in set(MEDIA_TYPES.values())}},
                                                **EVENT_STREAM, **error_responses(GENERATION)})
    async def speech(body: SpeechRequest) -> Response:
        client = await registry.route(body.model)
        tally = metrics.request(Api.SPEECH, body.model)
        job = body.job(REQUEST_ID.get())
        if body.instructions:
            logger.info("speech request: 'instructions' ignored (no voice here takes them)")
        logger.info("speech with model %s: %d characters, voice %s, %s as %s [X-Request-Id %s]", body.model,
                    len(body.input), job.voice[:64], body.response_format, body.stream_format, job.log_id)
        reader = ChunkReader(client.speak(job))
        first = await _first_event(reader, tally)
        if body.stream_format == "sse":
            return StreamingResponse(_sse(first, reader, tally, keepalive_s), media_type="text/event-stream",
                                     headers=SSE_HEADERS)
        return StreamingResponse(_audio(first, reader, tally), media_type=MEDIA_TYPES[body.response_format])

    return router


async def _first_event(reader: ChunkReader, tally: RequestTally) -> SpeechAudioEvent:
    """The first event with audio (or the end): a refusal before any audio is answered with its own status."""
    try:
        while True:
            event = await reader.next(None)
            if event.error is not None:
                raise event.error
            if event.audio or event.done:
                return event
    except BaseException as exc:
        if isinstance(exc, StopAsyncIteration):
            exc = OrchardError("the model ended the speech without audio")
        tally.end_by_exception(exc)
        await reader.aclose()
        raise exc from None


async def _audio(first: SpeechAudioEvent, reader: ChunkReader, tally: RequestTally) -> AsyncIterator[bytes]:
    async with _closing(reader, tally):
        event = first
        while True:
            if event.error is not None:
                tally.end(RequestOutcome.ERROR)
                raise SpeechStreamBroken(event.error.message)
            if event.audio:
                yield event.audio
            if event.done:
                tally.end(RequestOutcome.FINISHED)
                return
            event = await reader.next(None)


async def _sse(first: SpeechAudioEvent, reader: ChunkReader, tally: RequestTally,
               keepalive_s: float) -> AsyncIterator[str]:
    async with _closing(reader, tally):
        event: SpeechAudioEvent | None = first
        while True:
            if event is None:
                yield SSE_KEEPALIVE
            elif event.error is not None:
                tally.end(RequestOutcome.ERROR)
                yield sse_event(wire_error(event.error).body)
                return
            else:
                if event.audio:
                    yield sse_event(audio_delta_event(event.audio))
                if event.done:
                    tally.end(RequestOutcome.FINISHED)
                    yield sse_event(audio_done_event(event.usage))
                    return
            event = await reader.next(keepalive_s)


@contextlib.asynccontextmanager
async def _closing(reader: ChunkReader, tally: RequestTally):
    try:
        yield
    except StopAsyncIteration:
        tally.end(RequestOutcome.ERROR)
        raise SpeechStreamBroken("the model ended the speech before its last audio") from None
    finally:
        tally.end(RequestOutcome.ABORTED)  # counted once: a stream that ended above keeps its outcome
        await reader.aclose()
