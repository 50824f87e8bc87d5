"""Audio files in and out, in process with PyAV (FFmpeg's libraries, bundled in its wheel: no system package).

In: any container and codec FFmpeg reads (wav, mp3, flac, ogg/opus, webm, m4a/aac, ...) becomes 16 kHz mono float32,
what Whisper-class models read; the duration limit is checked while decoding, so a small file that decodes to hours
(a compressed bomb) stops at the limit. (Speech out: audio_out.py.)
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np

from engine.errors import InvalidRequestError

SAMPLE_RATE = 16_000  # what the speech-to-text models read


class UnreadableAudioError(InvalidRequestError):
    """The upload is not audio FFmpeg can read (names the field that carried it)."""

    code = "unreadable_audio"


class AudioTooLongError(InvalidRequestError):
    """The audio lasts longer than the model's limit (the message names the limit's setting)."""

    code = "audio_too_long"


@dataclass(frozen=True)
class DecodedAudio:
    samples: np.ndarray  # float32, mono, SAMPLE_RATE
    source_format: str  # the container FFmpeg found ("wav", "mp3", "ogg", ...)

    @property
    def seconds(self) -> float:
        return len(self.samples) / SAMPLE_RATE


def decode_audio(data: bytes, max_seconds: float, param: str = "file",
                 limit_name: str = "max_audio_seconds") -> DecodedAudio:
    """The file's first audio stream as 16 kHz mono float32; a 400 naming `param` when it is no audio, a 400 naming
    `limit_name` past `max_seconds`."""
    import av

    try:
        container = av.open(io.BytesIO(data), mode="r", metadata_errors="ignore")
    except (av.error.FFmpegError, ValueError) as exc:
        raise UnreadableAudioError(f"'{param}' is not an audio file this server can read ({_reason(exc)})",
                                   param=param) from exc
    with container:
        streams = container.streams.audio
        if not streams:
            raise UnreadableAudioError(f"'{param}' holds no audio stream", param=param)
        samples = _decoded_samples(container, streams[0], max_seconds, param, limit_name)
        return DecodedAudio(samples, container.format.name.split(",")[0])


def _decoded_samples(container, stream, max_seconds: float, param: str, limit_name: str) -> np.ndarray:
    import av

    resampler = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE)
    limit = int(max_seconds * SAMPLE_RATE)
    parts: list[np.ndarray] = []
    total = 0
    try:
        for frame in container.decode(stream):
            for out in resampler.resample(frame):
                parts.append(out.to_ndarray().reshape(-1))
                total += parts[-1].size
            if total > limit:
                raise AudioTooLongError(
                    f"'{param}' lasts longer than {max_seconds:g} s, this model's {limit_name}", param=param)
        for out in resampler.resample(None):  # the resampler's tail
            parts.append(out.to_ndarray().reshape(-1))
    except av.error.FFmpegError as exc:
        raise UnreadableAudioError(f"'{param}' could not be decoded ({_reason(exc)})", param=param) from exc
    samples = np.concatenate(parts).astype(np.float32, copy=False) if parts else np.zeros(0, np.float32)
    if samples.size == 0:
        raise UnreadableAudioError(f"'{param}' holds no audio samples", param=param)
    return samples[:limit]


def _reason(exc: BaseException) -> str:
    # FFmpeg's own words ("Invalid data found when processing input"), without the file name PyAV adds.
    return str(getattr(exc, "strerror", None) or exc).split(":")[0][:200]
