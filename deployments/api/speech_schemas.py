"""OpenAI's /v1/audio/speech request body and its streamed events (stream_format sse: speech.audio.delta with
base64 audio, then speech.audio.done with the usage). Unknown top-level fields are tolerated as on the other routes;
`instructions` (a tone for voices that take one) is accepted and logged: no model served here takes it."""

from __future__ import annotations

import base64
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from deployments.api.request_limits import refuse_invalid_unicode
from deployments.api.unknown_fields import accept_unknown_fields
from deployments.speech_calls import SpeakJob, SpeechUsage


class VoiceId(BaseModel):
    """OpenAI's custom voice reference, {"id": "voice_1234"}: here, the model's voice of that name."""

    model_config = ConfigDict(extra="allow")
    id: str = Field(min_length=1, max_length=256)


class SpeechRequest(BaseModel):
    model_config = ConfigDict(extra="allow", protected_namespaces=(), allow_inf_nan=False)

    model: str
    input: str = Field(min_length=1)  # the model's max_speech_input_chars bounds it (OpenAI's: 4096)
    voice: str | VoiceId
    instructions: str | None = None
    response_format: Literal["mp3", "opus", "aac", "flac", "wav", "pcm"] = "mp3"
    speed: float = Field(1.0, ge=0.25, le=4.0)
    stream_format: Literal["audio", "sse"] = "audio"

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, body: Any) -> Any:
        return refuse_invalid_unicode(body)

    @model_validator(mode="after")
    def _unknown_fields(self) -> "SpeechRequest":
        accept_unknown_fields("openai", self.model_extra)
        return self

    @field_validator("input")
    @classmethod
    def _something_to_say(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("'input' holds no text to speak")
        return value

    @property
    def voice_name(self) -> str:
        return self.voice.id if isinstance(self.voice, VoiceId) else self.voice

    def job(self, log_id: str) -> SpeakJob:
        return SpeakJob(self.input, self.voice_name, self.response_format, self.speed, log_id)


def audio_delta_event(audio: bytes) -> dict[str, Any]:
    return {"type": "speech.audio.delta", "audio": base64.b64encode(audio).decode()}


def audio_done_event(usage: SpeechUsage) -> dict[str, Any]:
    return {"type": "speech.audio.done", "usage": {"input_tokens": usage.input_tokens,
                                                   "output_tokens": usage.output_tokens,
                                                   "total_tokens": usage.total_tokens}}
