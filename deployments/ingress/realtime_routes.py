"""The Realtime API's transcription sessions: a WebSocket at /v1/realtime?intent=transcription (OpenAI's shape, so
its SDKs' realtime clients connect unchanged). Audio is appended as it is recorded; each item's transcript streams
back as it is spoken (realtime_session.py). Conversation sessions (?model=..., speech to speech) are not served."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

from fastapi import APIRouter, WebSocket, WebSocketDisconnect

from deployments.api.realtime_schemas import error_event
from deployments.ingress.model_registry import Registry
from deployments.ingress.realtime_session import TranscriptionSession
from deployments.speech_calls import TranscribeJob, Transcript
from engine.errors import InvalidRequestError, OrchardError

logger = logging.getLogger("ray.serve.orchard")
MAX_MESSAGE_CHARS = 8 * 1024 * 1024  # one append: ~2 minutes of base64 pcm at 24 kHz
POLICY_VIOLATION = 1008


def realtime_router(registry: Registry) -> APIRouter:
    router = APIRouter()

    async def transcribe(model: str, job: TranscribeJob) -> Transcript:
        client = await registry.route(model)
        async with contextlib.aclosing(client.transcribe(job)) as events:
            async for event in events:
                if event.error is not None:
                    raise event.error
                if event.transcript is not None:
                    return event.transcript
        raise OrchardError("the model ended the transcription without a transcript")

    @router.websocket("/v1/realtime")
    async def realtime(websocket: WebSocket) -> None:
        await websocket.accept()
        intent, model = websocket.query_params.get("intent"), websocket.query_params.get("model")
        lock = asyncio.Lock()

        async def send(event: dict) -> None:
            async with lock:  # the session's transcription tasks send too
                await websocket.send_text(json.dumps(event, ensure_ascii=False))

        if intent != "transcription":
            await send(error_event(InvalidRequestError(
                "only transcription sessions are served here: connect to /v1/realtime?intent=transcription",
                param="intent")))
            await websocket.close(POLICY_VIOLATION)
            return
        session = TranscriptionSession(transcribe, send, model)
        try:
            await session.start()
            while True:
                message = await websocket.receive()
                if message["type"] == "websocket.disconnect":
                    return
                text = message.get("text")
                if text is None or len(text) > MAX_MESSAGE_CHARS:
                    await send(error_event(InvalidRequestError(
                        f"client events are JSON text frames of at most {MAX_MESSAGE_CHARS} characters", param="type")))
                    continue
                event = _event(text)
                if event is None:
                    await send(error_event(InvalidRequestError("a client event is a JSON object with a 'type'",
                                                               param="type")))
                    continue
                await session.handle(event)
        except WebSocketDisconnect:
            pass
        finally:
            await session.close()

    return router


def _event(text: str) -> dict | None:
    try:
        event = json.loads(text)
    except ValueError:
        return None
    return event if isinstance(event, dict) else None
