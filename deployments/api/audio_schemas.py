"""OpenAI's audio transcription and translation requests (multipart forms) and their answers in each
response_format: json, text, srt, verbose_json, vtt; streamed as transcript.text.delta / .done events."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from deployments.speech_calls import Transcript, TranscribeJob
from engine.errors import InvalidRequestError

RESPONSE_FORMATS = ("json", "text", "srt", "verbose_json", "vtt")
GRANULARITIES = ("segment", "word")
# Fields OpenAI's API takes that change nothing here (they are logged as ignored).
_KNOWN = {"file", "model", "language", "prompt", "response_format", "temperature", "timestamp_granularities[]",
          "timestamp_granularities", "stream", "include[]", "include", "chunking_strategy"}


@dataclass
class TranscriptionForm:
    model: str
    audio: bytes
    filename: str
    task: str  # transcribe | translate
    language: str | None
    prompt: str | None
    response_format: str
    temperature: float
    stream: bool
    granularities: tuple[str, ...]
    ignored: tuple[str, ...]  # form fields Orchard does not read

    def job(self, log_id: str) -> TranscribeJob:
        return TranscribeJob(self.audio, self.task, self.language, self.prompt, self.temperature, log_id,
                             words="word" in self.granularities)


def transcription_form(fields: dict[str, list[Any]], task: str) -> TranscriptionForm:
    """The form's fields (each a list of values), checked: a 400 naming the field that is missing or wrong."""
    def text(name: str) -> str | None:
        values = fields.get(name) or []
        value = values[-1] if values else None
        if value is not None and not isinstance(value, str):
            raise InvalidRequestError(f"'{name}' must be text", param=name)
        return value or None

    model = text("model")
    if model is None:
        raise InvalidRequestError("'model' is required", param="model")
    response_format = text("response_format") or "json"
    if response_format not in RESPONSE_FORMATS:
        raise InvalidRequestError(f"'response_format' must be one of {', '.join(RESPONSE_FORMATS)}",
                                  param="response_format")
    stream = _boolean(text("stream"), "stream")
    granularities = tuple(fields.get("timestamp_granularities[]", []) + fields.get("timestamp_granularities", []))
    _check_granularities(granularities, response_format)
    if stream and response_format not in ("json", "text"):
        raise InvalidRequestError("'stream' answers transcript.text events: use response_format json or text",
                                  param="stream")
    if task == "translate" and text("language") is not None:
        raise InvalidRequestError("'language' is not a field of translations: they are always into English",
                                  param="language")
    return TranscriptionForm(model, b"", "", task, text("language"), text("prompt"), response_format,
                             _temperature(text("temperature")), stream, granularities,
                             tuple(sorted(set(fields) - _KNOWN)))


def _boolean(value: str | None, name: str) -> bool:
    if value is None:
        return False
    if value.lower() in ("true", "1"):
        return True
    if value.lower() in ("false", "0"):
        return False
    raise InvalidRequestError(f"'{name}' must be true or false", param=name)


def _temperature(value: str | None) -> float:
    if value is None:
        return 0.0
    try:
        temperature = float(value)
    except ValueError:
        raise InvalidRequestError("'temperature' must be a number from 0 to 1", param="temperature") from None
    if not 0.0 <= temperature <= 1.0 or math.isnan(temperature):
        raise InvalidRequestError("'temperature' must be a number from 0 to 1", param="temperature")
    return temperature


def _check_granularities(granularities: tuple[str, ...], response_format: str) -> None:
    for value in granularities:
        if value not in GRANULARITIES:
            raise InvalidRequestError("'timestamp_granularities[]' takes word and segment",
                                      param="timestamp_granularities[]")
    if granularities and response_format != "verbose_json":
        raise InvalidRequestError("'timestamp_granularities[]' needs response_format verbose_json",
                                  param="timestamp_granularities[]")


# ---- answers ------------------------------------------------------------------------------------------------
def usage(transcript: Transcript) -> dict[str, Any]:
    return {"type": "duration", "seconds": math.ceil(transcript.duration_s)}


def rendered(transcript: Transcript, form: TranscriptionForm) -> tuple[str, str]:
    """(body, media type) of the transcript in the form's response_format."""
    if form.response_format == "text":
        return transcript.text + "\n", "text/plain; charset=utf-8"
    if form.response_format == "srt":
        return _subtitles(transcript, ",", numbered=True), "text/plain; charset=utf-8"
    if form.response_format == "vtt":
        return "WEBVTT\n\n" + _subtitles(transcript, ".", numbered=False), "text/vtt; charset=utf-8"
    if form.response_format == "verbose_json":
        body = {"task": form.task, "language": transcript.language, "duration": transcript.duration_s,
                "text": transcript.text}
        if "word" in form.granularities:  # asked for by name; segments unless only words were asked for
            body["words"] = [vars(w) for w in transcript.words]
        if form.granularities != ("word",):
            body["segments"] = [vars(s) for s in transcript.segments]
        body["usage"] = usage(transcript)
        return json.dumps(body), "application/json"
    return json.dumps({"text": transcript.text, "usage": usage(transcript)}), "application/json"


def _subtitles(transcript: Transcript, decimal: str, numbered: bool) -> str:
    cues = []
    for number, segment in enumerate(transcript.segments, start=1):
        times = f"{_clock(segment.start, decimal)} --> {_clock(segment.end, decimal)}"
        cues.append((f"{number}\n" if numbered else "") + f"{times}\n{segment.text.strip()}\n")
    return "\n".join(cues)


def _clock(seconds: float, decimal: str) -> str:
    millis = round(seconds * 1000)
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    secs, millis = divmod(millis, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{decimal}{millis:03d}"


def delta_event(delta: str) -> dict[str, Any]:
    return {"type": "transcript.text.delta", "delta": delta}


def done_event(transcript: Transcript) -> dict[str, Any]:
    return {"type": "transcript.text.done", "text": transcript.text, "usage": usage(transcript)}
