"""What crosses between the ingress and a speech model (speech-to-text and text-to-speech): plain dataclasses (a contract module, as
model_calls.py is: both sides import it, it imports neither). Errors travel as values."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from engine.errors import OrchardError


@dataclass
class TranscribeJob:
    """One /v1/audio/transcriptions (or /translations) request: the uploaded file as sent, and what to do with it."""

    audio: bytes
    task: Literal["transcribe", "translate"] = "transcribe"
    language: str | None = None  # ISO-639-1; None: detected
    prompt: str | None = None
    temperature: float = 0.0
    log_id: str = ""
    words: bool = False  # word times wanted (timestamp_granularities[] word)


@dataclass
class TranscriptSegment:
    """A timed piece of the transcript: OpenAI's verbose_json segment."""

    id: int
    start: float
    end: float
    text: str
    tokens: list[int]
    temperature: float
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float


@dataclass
class TranscriptWord:
    """OpenAI's verbose_json word: the word as written, its start and end in seconds."""

    word: str
    start: float
    end: float


@dataclass
class Transcript:
    text: str
    language: str  # its English name, as OpenAI's verbose_json says it ("english")
    duration_s: float
    segments: list[TranscriptSegment] = field(default_factory=list)
    words: list[TranscriptWord] = field(default_factory=list)


@dataclass
class TranscriptEvent:
    """Text decoded since the previous event (`delta`); the last event carries the whole `transcript`, or `error`."""

    delta: str = ""
    transcript: Transcript | None = None
    error: OrchardError | None = None


@dataclass
class SpeakJob:
    """One /v1/audio/speech request: the text, the voice (a name the model has, or one of OpenAI's), the speed
    (0.25-4) and the response format the audio is encoded in on the model's side."""

    input: str
    voice: str
    response_format: str = "mp3"
    speed: float = 1.0
    log_id: str = ""


@dataclass
class SpeechUsage:
    input_tokens: int = 0  # what the model read (phoneme or text tokens)
    output_tokens: int = 0  # audio frames it wrote (20 ms each)

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens


@dataclass
class SpeechAudioEvent:
    """Encoded audio since the previous event (`audio`, maybe empty); the last event has `done` (with the usage), or
    `error`."""

    audio: bytes = b""
    done: bool = False
    usage: SpeechUsage | None = None
    error: OrchardError | None = None
