"""Speech out as OpenAI's response formats, a piece at a time (PyAV: FFmpeg's encoders in its wheel).

mp3, opus (in Ogg), aac (ADTS) and flac are encoded as the samples come, so a streamed answer's first bytes leave
after its first sentence. pcm is OpenAI's: raw 16-bit little-endian samples at 24 kHz, whatever the model's rate.
wav is written whole at the end, so its header holds the true sizes (a player may refuse a wav of unknown length).
"""

from __future__ import annotations

import io
import wave

import numpy as np

from engine.errors import InvalidRequestError

OUTPUT_FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")
MEDIA_TYPES = {"mp3": "audio/mpeg", "opus": "audio/ogg", "aac": "audio/aac", "flac": "audio/flac",
               "wav": "audio/wav", "pcm": "audio/pcm"}
PCM_RATE = 24_000  # OpenAI's pcm: 24 kHz, 16-bit signed, little-endian, mono
# OpenAI's response_format -> (container, codec).
_ENCODERS = {"mp3": ("mp3", "libmp3lame"), "opus": ("ogg", "libopus"), "aac": ("adts", "aac"),
             "flac": ("flac", "flac")}
_OPUS_RATE = 48_000  # the rates libopus takes: 48 kHz is the one every opus decoder plays


class _Sink:
    """A write-only file for FFmpeg's muxer: what it wrote since the last take()."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def write(self, data) -> int:
        self._parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        data, self._parts = b"".join(self._parts), []
        return data


class SpeechEncoder:
    """Mono float32 samples in, the response format's bytes out: add() what was synthesised, then finish()."""

    def __init__(self, response_format: str, sample_rate: int) -> None:
        if response_format not in OUTPUT_FORMATS:
            raise InvalidRequestError(f"'response_format' must be one of {', '.join(OUTPUT_FORMATS)}",
                                      param="response_format")
        self.response_format = response_format
        self.sample_rate = sample_rate
        self._wav: list[bytes] = []
        self._container = self._stream = self._resampler = None
        self._sink = _Sink()
        if response_format in _ENCODERS:
            self._open(*_ENCODERS[response_format])
        elif response_format == "pcm":
            import av

            self._resampler = av.AudioResampler(format="s16", layout="mono", rate=PCM_RATE)

    def _open(self, container_format: str, codec: str) -> None:
        import av

        self._container = av.open(self._sink, mode="w", format=container_format)
        rate = _OPUS_RATE if codec == "libopus" else self.sample_rate
        self._stream = self._container.add_stream(codec, rate=rate, layout="mono")
        self._resampler = av.AudioResampler(format=self._stream.format.name, layout="mono", rate=rate)

    def add(self, samples: np.ndarray) -> bytes:
        pcm16 = (np.clip(samples, -1.0, 1.0) * 32767.0).astype("<i2")
        if self.response_format == "wav":
            self._wav.append(pcm16.tobytes())
            return b""
        return self._encoded(self._frame(pcm16))

    def finish(self) -> bytes:
        if self.response_format == "wav":
            return wav_file(b"".join(self._wav), self.sample_rate)
        tail = self._encoded(None)
        if self._container is not None:
            for packet in self._stream.encode(None):
                self._container.mux(packet)
            self._container.close()
        return tail + self._sink.take()

    def _frame(self, pcm16: np.ndarray):
        import av

        frame = av.AudioFrame.from_ndarray(pcm16.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = self.sample_rate
        return frame

    def _encoded(self, frame) -> bytes:
        """The frame (None: the resampler's tail) resampled and encoded; what the muxer wrote meanwhile."""
        resampled = self._resampler.resample(frame)
        if self._container is None:  # pcm: the resampled samples are the answer
            return b"".join(bytes(f.planes[0])[: f.samples * 2] for f in resampled)
        for piece in resampled:
            for packet in self._stream.encode(piece):
                self._container.mux(packet)
        return self._sink.take()


def encode_audio(samples: np.ndarray, sample_rate: int, response_format: str) -> bytes:
    """Mono float32 samples in [-1, 1] as one file of OpenAI's `response_format`."""
    encoder = SpeechEncoder(response_format, sample_rate)
    return encoder.add(samples) + encoder.finish()


def wav_file(pcm16: bytes, sample_rate: int) -> bytes:
    """16-bit little-endian mono samples as a wav file."""
    out = io.BytesIO()
    with wave.open(out, "wb") as file:
        file.setnchannels(1)
        file.setsampwidth(2)
        file.setframerate(sample_rate)
        file.writeframes(pcm16)
    return out.getvalue()
