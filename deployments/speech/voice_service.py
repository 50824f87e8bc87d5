"""TextToSpeechService: a text-to-speech model (model_type tts) serving /v1/audio/speech, a sentence at a time.

Each request's text is cut into sentences; every sentence is one model call on the service's one synthesis thread, so
concurrent requests take turns sentence by sentence and the first sentence's audio leaves before the rest is spoken.
The audio is encoded here (audio_out.py), off the ingress. A client that goes away stops its request's next sentence.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import AsyncIterator, Iterator

from deployments.config import DEFAULT_TTS_MODEL_PATH, ModelConfig
from deployments.model_calls import ModelInfo, QueueStats
from deployments.speech.audio_out import SpeechEncoder
from deployments.route_service import OneRouteService
from deployments.speech_calls import SpeakJob, SpeechAudioEvent, SpeechUsage
from engine.errors import InvalidRequestError, ModelUnloadedError, OrchardError

logger = logging.getLogger("ray.serve.orchard")
# OpenAI's built-in voice names: a client written for OpenAI sends one, and hears the model's default voice.
OPENAI_VOICES = ("alloy", "ash", "ballad", "coral", "echo", "fable", "onyx", "nova", "sage", "shimmer", "verse",
                 "marin", "cedar")
FRAMES_PER_SECOND = 50  # usage's output_tokens: 20 ms audio frames


class TextToSpeechService(OneRouteService):
    kind = "text-to-speech"
    route = "/v1/audio/speech"

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self._voice = None
        self._folder: Path | None = None
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"tts-{config.id}"[:15])
        self._sentences_total = 0
        self._audio_seconds_total = 0.0

    async def start(self) -> None:
        started = time.monotonic()
        self._voice = await asyncio.get_running_loop().run_in_executor(self._thread, self._load)
        self.created_at = int(time.time())
        logger.info("text-to-speech model %s ready in %.1f s (voices: %s)", self.model_id, time.monotonic() - started,
                    ", ".join(self._voice.voices))

    def _load(self):
        from engine.speech.voices import default_voice_path, load_synthesizer

        path = self.config.model_path
        self._folder = default_voice_path() if path == DEFAULT_TTS_MODEL_PATH else Path(path)
        return load_synthesizer(self._folder)

    def voice_for(self, requested: str) -> str:
        """The model's voice a request's `voice` names: one of its own, or one of OpenAI's (its default voice)."""
        voices = self._voice.voices
        if requested in voices:
            return requested
        if requested in OPENAI_VOICES:
            return voices[0]
        raise InvalidRequestError(f"The model '{self.model_id}' has no voice '{requested[:64]}': choose one of "
                                  f"{', '.join(voices)} (OpenAI's voice names speak with {voices[0]})", param="voice")

    async def speak(self, job: SpeakJob) -> AsyncIterator[SpeechAudioEvent]:
        from engine.speech.synthesis import SpeechSpec

        try:
            if self._unloading or self._voice is None:
                raise ModelUnloadedError(f"The model '{self.model_id}' is not serving", param="model")
            if len(job.input) > self.config.max_speech_input_chars:
                raise InvalidRequestError(f"'input' holds {len(job.input)} characters, more than this model's "
                                          f"max_speech_input_chars ({self.config.max_speech_input_chars})",
                                          param="input")
            spec = SpeechSpec(job.input, self.voice_for(job.voice), job.speed)
            encoder = SpeechEncoder(job.response_format, self._voice.sample_rate)
        except OrchardError as exc:
            yield SpeechAudioEvent(error=exc)
            return
        self._active += 1
        pieces = self._voice.pieces(spec)
        try:
            async for event in self._spoken(pieces, encoder):
                yield event
        finally:
            self._active -= 1
            with contextlib.suppress(RuntimeError):  # the service shut down: its thread and generators are gone
                self._thread.submit(pieces.close)  # on the thread that may still be running it (a client gone)

    async def _spoken(self, pieces: Iterator, encoder: SpeechEncoder) -> AsyncIterator[SpeechAudioEvent]:
        loop = asyncio.get_running_loop()
        usage = SpeechUsage()
        samples = 0
        try:
            while True:
                piece, audio = await loop.run_in_executor(self._thread, _next_encoded, pieces, encoder)
                if piece is None:
                    break
                usage.input_tokens += piece.input_tokens
                samples += piece.samples.size
                self._sentences_total += 1
                if audio:
                    yield SpeechAudioEvent(audio=audio)
            seconds = samples / self._voice.sample_rate
            usage.output_tokens = round(seconds * FRAMES_PER_SECOND)
            self._audio_seconds_total += seconds
            yield SpeechAudioEvent(audio=encoder.finish(), done=True, usage=usage)
        except OrchardError as exc:
            yield SpeechAudioEvent(error=exc)
        except Exception as exc:  # the model's own failure: the request ends with it, the service serves on
            logger.exception("text-to-speech model %s failed", self.model_id)
            yield SpeechAudioEvent(error=OrchardError(f"speech synthesis failed: {exc!r}"[:500]))

    def info(self) -> ModelInfo:
        return self._info(str(self._folder or self.config.model_path), 0)

    def queue_stats(self) -> QueueStats:
        return QueueStats(
            model_id=self.model_id, waiting=0, running=self._active, decoding=self._active, max_num_seqs=1,
            queue_size=None, kv_cache_bytes=0, prompt_tokens_total=0, generation_tokens_total=self._sentences_total,
            tokens_per_s=0.0, steps_total=self._sentences_total, step_seconds_total=0.0, step_cpu_seconds_total=0.0,
            process_cpu_seconds_total=round(time.process_time(), 4),
        )

    async def shutdown(self) -> None:
        await super().shutdown()
        self._thread.shutdown(wait=False, cancel_futures=True)


def _next_encoded(pieces: Iterator, encoder: SpeechEncoder):
    """The next sentence's speech and its encoded bytes (None, b"" past the last): one model call, on the thread."""
    piece = next(pieces, None)
    return (piece, encoder.add(piece.samples)) if piece is not None else (None, b"")
