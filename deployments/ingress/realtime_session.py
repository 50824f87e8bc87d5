"""One Realtime transcription session (a WebSocket): the audio a client appends as it records, cut into items (by
its commits, or by server_vad at the end of speech), each item transcribed by a speech-to-text model when it ends.

While an item is spoken, its audio so far is transcribed again every second from its second second on (at most one
such pass at a time, the first 30 s only), and the words two passes in a row agree on are sent as transcription
deltas (the first time, two words at least): partial text that is not taken back. The completed event carries the
item's whole transcript, decoded once the item ended; on hard audio its first words can differ from the deltas'.
"""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import numpy as np

from deployments.api.realtime_schemas import (
    PCM_RATE, TranscriptionSessionConfig, appended_audio, error_event, new_id, server_event,
)
from deployments.speech.audio_out import wav_file
from deployments.speech_calls import TranscribeJob, Transcript
from engine.errors import InvalidRequestError, OrchardError

logger = logging.getLogger("ray.serve.orchard")
BYTES_PER_S = PCM_RATE * 2
PARTIAL_EVERY_S = 1.0
PARTIAL_FIRST_S = 2.0  # a pass over the first second alone mostly guesses
FIRST_AGREED_WORDS = 2  # an item's first delta: at least two words two passes agree on
PARTIAL_MAX_S = 30.0  # one Whisper window: past it only the item's end is transcribed
MAX_ITEM_S = 900.0  # an item's audio held in the ingress (43 MB): past it the item is committed
FRAME_BYTES = BYTES_PER_S // 50  # server_vad's 20 ms frames

Transcribe = Callable[[str, TranscribeJob], Awaitable[Transcript]]


@dataclass
class Item:
    """The audio of the item being spoken, and the text already sent for it."""

    id: str
    audio: bytearray = field(default_factory=bytearray)
    sent_words: list[str] = field(default_factory=list)
    last_partial: list[str] = field(default_factory=list)
    audio_at_partial: int = 0


@dataclass
class SpeechDetector:
    """server_vad's state: in speech or not, the silence since the last speech, the padding kept before speech."""

    speaking: bool = False
    silence_ms: int = 0
    padding: bytearray = field(default_factory=bytearray)
    received_ms: int = 0


class TranscriptionSession:
    def __init__(self, transcribe: Transcribe, send: Callable[[dict], Awaitable[None]],
                 default_model: str | None = None) -> None:
        self.config = TranscriptionSessionConfig()
        if default_model:
            self.config = self.config.updated({"audio": {"input": {"transcription": {"model": default_model}}}})
        self._transcribe = transcribe
        self._send = send
        self._item: Item | None = None
        self._previous_item: str | None = None
        self._detector = SpeechDetector()
        self._pending = b""  # the tail of an append shorter than a detector frame
        self._partial: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        await self._send(server_event("session.created", session=self.config.model_dump()))

    async def handle(self, event: dict[str, Any]) -> None:
        try:
            kind = event.get("type")
            if kind == "session.update":
                self.config = self.config.updated(event.get("session") or {})
                await self._send(server_event("session.updated", session=self.config.model_dump()))
            elif kind == "input_audio_buffer.append":
                await self._append(appended_audio(event))
            elif kind == "input_audio_buffer.commit":
                if self._item is None or not self._item.audio:
                    raise InvalidRequestError("the input audio buffer is empty", param="audio")
                await self._commit()
            elif kind == "input_audio_buffer.clear":
                self._item = None
                self._pending = b""
                await self._send(server_event("input_audio_buffer.cleared"))
            else:
                raise InvalidRequestError(f"a transcription session takes session.update and input_audio_buffer."
                                          f"append/commit/clear, not {str(kind)[:64]!r}", param="type")
        except InvalidRequestError as exc:
            await self._send(error_event(exc, event.get("event_id")))

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # ---- audio in ----------------------------------------------------------------------------------
    async def _append(self, audio: bytes) -> None:
        if self.config.audio.input.turn_detection is None:
            if self._item is None:
                self._item = Item(new_id("item"))
            self._item.audio += audio
        else:
            await self._detect(audio)
        if self._item is not None and len(self._item.audio) >= MAX_ITEM_S * BYTES_PER_S:
            await self._commit()
        self._maybe_partial()

    async def _detect(self, audio: bytes) -> None:
        """server_vad: an item starts at the first loud frame (with prefix_padding_ms before it) and is committed
        after silence_duration_ms of quiet frames."""
        vad, rules = self._detector, self.config.audio.input.turn_detection
        data = self._pending + audio
        whole = len(data) - len(data) % FRAME_BYTES
        self._pending = data[whole:]
        for start in range(0, whole, FRAME_BYTES):
            frame = data[start:start + FRAME_BYTES]
            vad.received_ms += 20
            loud = _rms(frame) > rules.threshold / 10
            if not vad.speaking:
                vad.padding = (vad.padding + frame)[-(rules.prefix_padding_ms * BYTES_PER_S // 1000):]
                if loud:
                    vad.speaking, vad.silence_ms = True, 0
                    self._item = Item(new_id("item"), bytearray(vad.padding))
                    vad.padding = bytearray()
                    start_ms = max(vad.received_ms - 20 - rules.prefix_padding_ms, 0)
                    await self._send(server_event("input_audio_buffer.speech_started", audio_start_ms=start_ms,
                                                  item_id=self._item.id))
                continue
            self._item.audio += frame
            vad.silence_ms = 0 if loud else vad.silence_ms + 20
            if vad.silence_ms >= rules.silence_duration_ms:
                await self._send(server_event("input_audio_buffer.speech_stopped", audio_end_ms=vad.received_ms,
                                              item_id=self._item.id))
                await self._commit()

    async def _commit(self) -> None:
        item, self._item = self._item, None
        self._detector.speaking, self._detector.silence_ms = False, 0
        await self._send(server_event("input_audio_buffer.committed", item_id=item.id,
                                      previous_item_id=self._previous_item))
        self._previous_item = item.id
        if self._transcription() is not None:
            self._spawn(self._final(item, self._partial))

    # ---- transcripts out --------------------------------------------------------------------------
    def _transcription(self):
        transcription = self.config.audio.input.transcription
        return transcription if transcription is not None and transcription.model else None

    def _job(self, audio: bytes) -> tuple[str, TranscribeJob]:
        options = self._transcription()
        return options.model, TranscribeJob(wav_file(audio, PCM_RATE), "transcribe", options.language, options.prompt)

    def _maybe_partial(self) -> None:
        item = self._item
        if item is None or self._transcription() is None or (self._partial and not self._partial.done()):
            return
        heard = len(item.audio)
        if heard < PARTIAL_FIRST_S * BYTES_PER_S or heard - item.audio_at_partial < PARTIAL_EVERY_S * BYTES_PER_S or \
                heard > PARTIAL_MAX_S * BYTES_PER_S:
            return
        item.audio_at_partial = len(item.audio)
        self._partial = self._spawn(self._partial_pass(item, bytes(item.audio)))

    async def _partial_pass(self, item: Item, audio: bytes) -> None:
        try:
            words = (await self._transcribe(*self._job(audio))).text.split()
        except OrchardError as exc:  # the item's final pass reports failures
            logger.info("realtime partial transcript failed: %s", exc.message)
            return
        agreed = _common_prefix(words, item.last_partial)
        item.last_partial = words
        enough = len(agreed) >= (FIRST_AGREED_WORDS if not item.sent_words else len(item.sent_words) + 1)
        if self._item is item and enough and _same(agreed, item.sent_words):
            await self._delta(item, agreed)

    async def _final(self, item: Item, partial: asyncio.Task | None) -> None:
        if partial is not None:  # a pass still running may send words the final text must continue
            await asyncio.gather(partial, return_exceptions=True)
        try:
            transcript = await self._transcribe(*self._job(bytes(item.audio)))
        except OrchardError as exc:
            error = {"type": "invalid_request_error" if isinstance(exc, InvalidRequestError) else "server_error",
                     "code": exc.code, "message": exc.message, "param": exc.param}
            await self._send(server_event("conversation.item.input_audio_transcription.failed", item_id=item.id,
                                          content_index=0, error=error))
            return
        words = transcript.text.split()
        if len(words) > len(item.sent_words) and _same(words, item.sent_words):
            await self._delta(item, words)
        await self._send(server_event(
            "conversation.item.input_audio_transcription.completed", item_id=item.id, content_index=0,
            transcript=transcript.text, usage={"type": "duration", "seconds": round(len(item.audio) / BYTES_PER_S, 3)}))

    async def _delta(self, item: Item, words: list[str]) -> None:
        new = words[len(item.sent_words):]
        delta = (" " if item.sent_words else "") + " ".join(new)
        item.sent_words = list(words)
        await self._send(server_event("conversation.item.input_audio_transcription.delta", item_id=item.id,
                                      content_index=0, delta=delta))

    def _spawn(self, work: Awaitable[None]) -> asyncio.Task:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(_finished)
        task.add_done_callback(self._tasks.discard)
        return task


def _key(word: str) -> str:
    """A word as two passes are compared: "Today?" and "today." agree."""
    return re.sub(r"[^\w']", "", word.lower())


def _finished(task: asyncio.Task) -> None:
    """A pass whose client went away fails on its send: that is the end of it, not an error to report."""
    if not task.cancelled() and task.exception() is not None:
        logger.info("realtime transcription pass ended: %r", task.exception())


def _common_prefix(words: list[str], other: list[str]) -> list[str]:
    """The words (as the newer pass wrote them) both passes begin with."""
    n = 0
    while n < min(len(words), len(other)) and _key(words[n]) == _key(other[n]):
        n += 1
    return words[:n]


def _same(words: list[str], sent: list[str]) -> bool:
    """Whether `words` begins with the words already sent."""
    return len(_common_prefix(words, sent)) == len(sent)


def _rms(frame: bytes) -> float:
    samples = np.frombuffer(frame, dtype="<i2").astype(np.float32) / 32768.0
    return float(np.sqrt(np.mean(samples * samples))) if samples.size else 0.0
