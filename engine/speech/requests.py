"""What a transcription asks for and what the speech engine answers, as plain data (no MLX)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class TranscriptionRequest:
    request_id: str
    samples: np.ndarray  # float32 mono at 16 kHz
    language: str | None = None  # None: detected from the first window
    task: str = "transcribe"  # or "translate" (into English)
    prompt: str | None = None  # earlier text, to steer spelling and style
    temperature: float = 0.0
    timestamps: bool = False  # segment times wanted (verbose_json, srt, vtt, timestamp_granularities)
    words: bool = False  # word times wanted (timestamp_granularities[] word)


@dataclass
class WordTime:
    word: str  # as written, its leading space included
    start: float  # seconds from the window's start
    end: float
    probability: float


@dataclass
class WindowResult:
    """One 30 s window decoded: its sampled tokens (timestamps included) and how sure the model was."""

    index: int
    offset_s: float  # where the window starts in the audio
    duration_s: float  # the audio it holds (the last window is shorter)
    tokens: list[int]
    avg_logprob: float
    no_speech_prob: float
    temperature: float
    words: list[WordTime] = field(default_factory=list)  # when the request asked for word times


@dataclass
class TranscriptDelta:
    """Text decoded so far, in order: the windows' text as it comes, for streamed answers."""

    request_id: str
    text: str


@dataclass
class TranscriptDone:
    request_id: str
    language: str
    windows: list[WindowResult]
    prompt_tokens: int = 0
    error: Exception | None = None
    duration_s: float = 0.0


@dataclass
class TimestampState:
    """Per window, what Whisper's timestamp rules need from the tokens sampled so far."""

    last_was_timestamp: bool = False
    penultimate_was_timestamp: bool = True  # OpenAI's rule treats "fewer than two sampled" as a timestamp
    last_timestamp: int | None = None
    sampled: int = 0
    text_tokens: list[int] = field(default_factory=list)
