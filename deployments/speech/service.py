"""SpeechService: a Whisper-class model serving transcriptions (its engine, engine/speech/, on a thread of its own).

Answers the calls a chat ModelService answers (model/deployment.py and ingress/local_models.py pick the service by
model_type); chat and embedding calls get a clear 400 (deployments/route_service.py). The uploaded file is decoded here (PyAV), off the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
import zlib
from typing import AsyncIterator

from deployments.config import DEFAULT_STT_MODEL_PATH, ModelConfig
from deployments.model_calls import ModelInfo, QueueStats
from deployments.route_service import OneRouteService
from deployments.speech.audio_io import decode_audio
from deployments.speech_calls import TranscribeJob, Transcript, TranscriptEvent, TranscriptSegment, TranscriptWord
from engine.errors import ModelUnloadedError, OrchardError

logger = logging.getLogger("ray.serve.orchard")
CPU_MAX_SLOTS = 4


class SpeechService(OneRouteService):
    kind = "speech-to-text"
    route = "/v1/audio/transcriptions"

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self._engine = None
        self._whisper = None
        self._audio_seconds_total = 0.0

    async def start(self) -> None:
        started = time.monotonic()
        self._engine = await asyncio.to_thread(self._load)
        self._engine.start()
        self.created_at = int(time.time())
        logger.info("speech model %s ready in %.1f s (%d decoder slots)", self.model_id, time.monotonic() - started,
                    self._engine.slots)

    def _load(self):
        from pathlib import Path

        import mlx.core as mx

        from engine.speech.default_speech_model import default_stt_path
        from engine.speech.speech_engine import SpeechEngine
        from engine.speech.whisper_model import load_whisper

        folder = default_stt_path() if self.config.model_path == DEFAULT_STT_MODEL_PATH else Path(self.config.model_path)
        self._whisper = load_whisper(folder)
        gpu = mx.default_device() == mx.gpu
        # A slot holds a window's caches (~48 MB for Whisper base); a CPU decodes few windows at once: at most 4 there.
        slots = self.config.max_decode_seqs if gpu else min(self.config.max_decode_seqs, CPU_MAX_SLOTS)
        return SpeechEngine(self._whisper, slots=slots, encode_batch=8 if gpu else 2)

    # ---- transcription --------------------------------------------------------------------------------
    async def transcribe(self, job: TranscribeJob) -> AsyncIterator[TranscriptEvent]:
        request_id = uuid.uuid4().hex
        try:
            if self._unloading or self._engine is None:
                raise ModelUnloadedError(f"The model '{self.model_id}' is not serving", param="model")
            audio = await asyncio.to_thread(decode_audio, job.audio, self.config.max_audio_seconds)
        except OrchardError as exc:
            yield TranscriptEvent(error=exc)
            return
        events: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        from engine.speech.requests import TranscriptDelta, TranscriptionRequest

        spec = TranscriptionRequest(request_id, audio.samples, job.language, job.task, job.prompt, job.temperature,
                                    words=job.words)
        self._active += 1
        try:
            self._engine.submit(spec, lambda event: loop.call_soon_threadsafe(events.put_nowait, event))
            streamed = False
            while True:
                event = await events.get()
                if isinstance(event, TranscriptDelta):
                    streamed = True
                    yield TranscriptEvent(delta=event.text)
                    continue
                final = self._final(event, audio.seconds)
                if not streamed and final.transcript is not None and final.transcript.text:
                    # A long file's windows are stitched once all are decoded: its text comes as one delta.
                    yield TranscriptEvent(delta=final.transcript.text)
                yield final
                return
        except OrchardError as exc:
            yield TranscriptEvent(error=exc)
        finally:
            self._active -= 1
            self._engine.cancel(request_id)  # a client gone mid-way: its windows stop decoding

    def _final(self, done, seconds: float) -> TranscriptEvent:
        from engine.speech.transcript import merged_segments

        if done.error is not None:
            error = done.error if isinstance(done.error, OrchardError) else OrchardError(repr(done.error))
            return TranscriptEvent(error=error)
        tokens = self._whisper.tokens
        segments = merged_segments(done.windows, tokens.timestamp_begin, tokens.eot)
        out = [_segment(i, s, self._whisper.decode_text(list(s.tokens))) for i, s in enumerate(segments)]
        self._audio_seconds_total += seconds
        text = "".join(s.text for s in out).strip()
        return TranscriptEvent(transcript=Transcript(text, _language_name(done.language), round(seconds, 3), out,
                                                     _words(done.windows)))

    # ---- lifecycle and introspection ------------------------------------------------------------------
    async def shutdown(self) -> None:
        await super().shutdown()
        if self._engine is not None:
            await asyncio.to_thread(self._engine.stop)

    def info(self) -> ModelInfo:
        whisper = self._whisper
        return self._info(str(whisper.path) if whisper else self.config.model_path,
                          whisper.dims.n_text_ctx if whisper else 0)

    def queue_stats(self) -> QueueStats:
        engine = self._engine
        return QueueStats(
            model_id=self.model_id, waiting=engine.waiting_windows if engine else 0,
            running=engine.active_windows if engine else 0, decoding=engine.active_windows if engine else 0,
            max_num_seqs=engine.slots if engine else 0, queue_size=None,
            kv_cache_bytes=engine.decoder.caches.nbytes if engine else 0, prompt_tokens_total=0,
            generation_tokens_total=engine.tokens_total if engine else 0, tokens_per_s=0.0,
            steps_total=engine.steps if engine else 0, step_seconds_total=0.0, step_cpu_seconds_total=0.0,
            process_cpu_seconds_total=round(time.process_time(), 4),
        )


def _segment(index: int, segment, text: str) -> TranscriptSegment:
    encoded = text.encode()
    ratio = len(encoded) / max(len(zlib.compress(encoded)), 1) if encoded else 0.0
    return TranscriptSegment(index, round(segment.start, 2), round(segment.end, 2), text, list(segment.tokens),
                             segment.temperature, round(segment.avg_logprob, 4), round(ratio, 4),
                             round(segment.no_speech_prob, 4))


def _words(windows) -> list[TranscriptWord]:
    """Every window's words on the audio's clock; a later window's words inside the audio already covered (its 5 s
    overlap with the one before) are dropped, as the segments' stitching drops their repeat."""
    words: list[TranscriptWord] = []
    for window in windows:
        for word in window.words:
            start, end = round(window.offset_s + word.start, 2), round(window.offset_s + word.end, 2)
            if words and start < words[-1].end:
                continue
            words.append(TranscriptWord(word.word.strip(), start, end))
    return words


def _language_name(code: str) -> str:
    from mlx_audio.stt.models.whisper.tokenizer import LANGUAGES

    return LANGUAGES.get(code, code)
