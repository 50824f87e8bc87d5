"""OpenAI's Realtime API, transcription sessions (wss .../v1/realtime?intent=transcription): the client events a
transcription session takes and the server events it sends, GA shapes. Audio in is `audio/pcm` at 24 kHz (16-bit
little-endian mono, base64 in input_audio_buffer.append), as OpenAI's."""

from __future__ import annotations

import base64
import binascii
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.errors import InvalidRequestError

PCM_RATE = 24_000
CLIENT_EVENTS = ("session.update", "input_audio_buffer.append", "input_audio_buffer.commit",
                 "input_audio_buffer.clear")


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")  # new fields from newer clients are accepted (and do nothing)


class AudioFormat(_Open):
    type: Literal["audio/pcm"] = "audio/pcm"
    rate: Literal[24000] = 24000


class Transcription(_Open):
    model: str | None = None
    language: str | None = Field(None, pattern=r"^[a-z]{2,3}$")
    prompt: str | None = Field(None, max_length=2000)


class TurnDetection(_Open):
    """server_vad here is an energy detector: a 20 ms frame is speech when its RMS exceeds threshold / 10."""

    type: Literal["server_vad"] = "server_vad"
    threshold: float = Field(0.5, ge=0.0, le=1.0)
    prefix_padding_ms: int = Field(300, ge=0, le=5000)
    silence_duration_ms: int = Field(500, ge=100, le=10_000)


class AudioInput(_Open):
    format: AudioFormat = Field(default_factory=AudioFormat)
    transcription: Transcription | None = None
    turn_detection: TurnDetection | None = Field(default_factory=TurnDetection)


class SessionAudio(_Open):
    input: AudioInput = Field(default_factory=AudioInput)


class TranscriptionSessionConfig(_Open):
    type: Literal["transcription"] = "transcription"
    audio: SessionAudio = Field(default_factory=SessionAudio)

    def updated(self, update: dict[str, Any]) -> "TranscriptionSessionConfig":
        """This config with the fields `update` names replaced (OpenAI's session.update: absent fields stay)."""
        merged = _merged(self.model_dump(), update)
        try:
            return TranscriptionSessionConfig.model_validate(merged)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise InvalidRequestError(f"session.{where}: {first['msg']}", param=f"session.{where}") from None


def _merged(current: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = dict(current)
    for name, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(name), dict):
            out[name] = _merged(out[name], value)
        else:
            out[name] = value  # None clears (turn_detection: null turns the detector off)
    return out


def appended_audio(event: dict[str, Any]) -> bytes:
    """input_audio_buffer.append's audio: base64 of 16-bit samples."""
    audio = event.get("audio")
    if not isinstance(audio, str):
        raise InvalidRequestError("input_audio_buffer.append needs 'audio': base64 of 16-bit 24 kHz pcm",
                                  param="audio")
    try:
        data = base64.b64decode(audio, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError("'audio' is not valid base64", param="audio") from None
    if len(data) % 2:
        raise InvalidRequestError("'audio' must hold whole 16-bit samples (an even number of bytes)", param="audio")
    return data


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:22]}"


def server_event(kind: str, **fields: Any) -> dict[str, Any]:
    return {"type": kind, "event_id": new_id("event"), **fields}


def error_event(error: InvalidRequestError | Exception, client_event_id: str | None = None) -> dict[str, Any]:
    code = getattr(error, "code", "server_error")
    kind = "invalid_request_error" if isinstance(error, InvalidRequestError) else "server_error"
    return server_event("error", error={"type": kind, "code": code, "message": getattr(error, "message", str(error)),
                                        "param": getattr(error, "param", None), "event_id": client_event_id})
