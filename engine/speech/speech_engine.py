"""The speech engine: continuous batching of Whisper windows across requests, on a thread of its own.

A request's audio is cut into 30 s windows (transcript.py). Each step of the loop (1) encodes up to `encode_batch`
waiting windows in one encoder call and gives each a decoder slot (its cross-attention caches and its prompt), then
(2) decodes one token for every window holding a slot, all in one batched decoder call (batch_decoder.py). A window
that ends frees its slot for the next. Requests arrive and leave between steps; the caller hears back through the
`emit` callback it passed (TranscriptDelta while text is decoded, then one TranscriptDone), called on this thread.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx
import numpy as np

from engine.errors import InvalidRequestError
from engine.speech.batch_decoder import BatchDecoder
from engine.speech.batch_sampler import BatchSampler
from engine.speech.requests import TimestampState, TranscriptDelta, TranscriptDone, TranscriptionRequest, WindowResult
from engine.speech.timestamp_rules import after_sampling, forbidden_next
from engine.speech.transcript import SAMPLE_RATE, window_offsets
from engine.speech.whisper_model import LoadedWhisper, window_mel
from engine.speech.word_timing import window_words

HOP_SAMPLES = 1600  # 0.1 s: enough audio to build the features once

logger = logging.getLogger("orchard.speech")
Emit = Callable[[object], None]


@dataclass
class _Request:
    spec: TranscriptionRequest
    emit: Emit
    offsets: list[tuple[float, float]]
    waiting: deque[int]  # windows not yet given a slot
    language: str | None
    prompt: list[int]  # <|startofprev|> and the prompt's tokens, or nothing
    results: dict[int, WindowResult] = field(default_factory=dict)
    streamed: str = ""  # the first window's text sent so far (later windows stream once merged)
    cancelled: bool = False
    finished: bool = False  # its TranscriptDone was emitted (or it was cancelled: nobody listens)

    @property
    def done(self) -> bool:
        return len(self.results) == len(self.offsets)


@dataclass
class _Row:
    """A window holding a decoder slot."""

    request: _Request
    window: int
    position: int  # the next position to feed
    token: int  # the token to feed there
    sample_begin: int
    features: mx.array | None = None  # the window's encoded audio, kept for its word times
    state: TimestampState = field(default_factory=TimestampState)
    sampled: list[int] = field(default_factory=list)
    logprob_sum: float = 0.0
    no_speech_prob: float = 0.0


class SpeechEngine:
    def __init__(self, whisper: LoadedWhisper, slots: int, encode_batch: int) -> None:
        self.whisper = whisper
        self.tokens = whisper.tokens
        self.dims = whisper.dims
        self.decoder = BatchDecoder(whisper.model, slots, whisper.dtype)
        self.sampler = BatchSampler(self.dims.n_vocab, self.tokens.suppressed, self.tokens.timestamp_begin)
        self.slots = slots
        self.encode_batch = encode_batch
        self.max_sampled = self.dims.n_text_ctx // 2  # Whisper's sample_len
        # mlx-audio builds its mel filters and window once (lru_cache): here, not in the first request.
        mx.eval(window_mel(np.zeros(HOP_SAMPLES, np.float32), self.dims.n_mels))
        self._requests: deque[_Request] = deque()
        self._rows: list[_Row] = []
        self._lock = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.steps = 0
        self.tokens_total = 0

    @property
    def waiting_windows(self) -> int:
        return sum(len(r.waiting) for r in list(self._requests))

    @property
    def active_windows(self) -> int:
        return len(self._rows)

    # ---- the caller's side --------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="orchard-speech", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def submit(self, spec: TranscriptionRequest, emit: Emit) -> None:
        """Queue a request (its language, prompt and task checked now: InvalidRequestError)."""
        language = None if spec.language is None else self._checked_language(spec.language)
        if spec.task not in ("transcribe", "translate"):
            raise InvalidRequestError("task must be transcribe or translate", param="task")
        offsets = window_offsets(len(spec.samples))
        request = _Request(spec, emit, offsets, deque(range(len(offsets))), language, self._prompt_tokens(spec))
        with self._lock:
            self._requests.append(request)
            self._lock.notify_all()

    def cancel(self, request_id: str) -> None:
        with self._lock:
            for request in [*self._requests, *(row.request for row in self._rows)]:
                if request.spec.request_id == request_id:
                    request.cancelled = True

    def _checked_language(self, language: str) -> str:
        try:
            token = self.tokens.language_token(language)
        except KeyError:
            raise InvalidRequestError(f"language '{language}' is not one this model knows (ISO-639-1, e.g. 'en')",
                                      param="language") from None
        return self.tokens.language_of(token) or language

    def _prompt_tokens(self, spec: TranscriptionRequest) -> list[int]:
        if not spec.prompt:
            return []
        text = self.whisper.encode_text(" " + spec.prompt.strip())
        return [self.tokens.sot_prev, *text[-(self.dims.n_text_ctx // 2 - 1):]]

    # ---- the loop ------------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        finally:
            # This thread's arrays and streams go with it: MLX aborts the process at exit if a stream outlives the
            # thread that made it (seen after a transcription: "terminate called without an active exception").
            self._rows.clear()
            self.decoder.close()
            mx.synchronize()
            mx.clear_streams()

    def _loop(self) -> None:
        stream = mx.new_stream(mx.default_device())  # MLX's streams belong to the thread that made them
        while True:
            with self._lock:
                while not self._stopping and not self._rows and not self._admissible():
                    self._lock.wait()
                if self._stopping:
                    return
                admitted = self._take_windows()
            try:
                with mx.stream(stream):
                    self._admit(admitted)
                    self._release_finished()  # a window whose first token ended it
                    if self._rows:
                        self._step()
                    mx.eval(self.decoder.caches.arrays())  # a slot's move, left lazy, would wait a step
            except Exception as exc:  # a bug or the device: fail what runs, keep serving the rest
                logger.exception("speech engine step failed")
                self._fail_all(exc)

    def _admissible(self) -> bool:
        return any(r.waiting and (r.language is not None or 0 in r.waiting) for r in self._requests)

    def _take_windows(self) -> list[tuple[_Request, int]]:
        """Windows to give slots now: in arrival order; a request whose language is unknown sends its first
        window alone (the others wait for the language it finds)."""
        free = min(self.slots - len(self._rows), self.encode_batch)
        taken: list[tuple[_Request, int]] = []
        for request in list(self._requests):
            if request.cancelled:  # its windows never start; those decoding end at the next release
                self._requests.remove(request)
                continue
            while free > len(taken) and request.waiting and (request.language is not None or
                                                               request.waiting[0] == 0 and not taken_from(taken, request)):
                taken.append((request, request.waiting.popleft()))
            if not request.waiting:
                self._requests.remove(request)
        return taken

    def _admit(self, admitted: list[tuple[_Request, int]]) -> None:
        admitted = [(r, w) for r, w in admitted if not r.cancelled]
        if not admitted:
            return
        mels = mx.stack([window_mel(self._window_samples(r, w), self.dims.n_mels) for r, w in admitted])
        audio = self.decoder.encode(mels)
        for (request, window), features in zip(admitted, audio):
            slot = len(self._rows)
            self.decoder.admit(slot, features)
            row = self._prefilled(request, window, slot)
            row.features = features if request.spec.words else None
            self._rows.append(row)

    def _window_samples(self, request: _Request, window: int):
        offset, duration = request.offsets[window]
        start = int(offset * SAMPLE_RATE)
        return request.spec.samples[start:start + int(duration * SAMPLE_RATE)]

    def _prefilled(self, request: _Request, window: int, slot: int) -> _Row:
        """Feed the window's prompt; a request without a language finds it here, from its first window."""
        tokens = self.tokens
        fed = [*request.prompt, tokens.sot]
        logits = self.decoder.prefill(slot, fed, 0)
        no_speech = mx.softmax(logits[-1])[tokens.no_speech].item() if tokens.no_speech is not None else 0.0
        if request.language is None:
            request.language = self._detected_language(logits[-1])
            with self._lock:
                self._lock.notify_all()
        rest = [tokens.language_token(request.language), tokens.transcribe if request.spec.task == "transcribe"
                else tokens.translate]
        logits = self.decoder.prefill(slot, rest, len(fed))
        row = _Row(request, window, len(fed) + len(rest), -1, len(fed) + len(rest), no_speech_prob=no_speech)
        self._sample([row], logits[-1:])
        return row

    def _detected_language(self, logits: mx.array) -> str:
        ids = list(self.tokens.languages.values())
        best = ids[int(mx.argmax(logits[mx.array(ids)]).item())]
        return self.tokens.language_of(best) or "en"

    def _step(self) -> None:
        rows = self._rows
        logits = self.decoder.step([r.token for r in rows], [r.position for r in rows])
        for row in rows:
            row.position += 1
        self._sample(rows, logits)
        self.steps += 1
        self._release_finished()

    def _sample(self, rows: list[_Row], logits: mx.array) -> None:
        t = self.tokens
        forbidden = [forbidden_next(r.state, True, t.eot, t.blank, t.no_timestamps, t.timestamp_begin,
                                    self.dims.n_vocab) for r in rows]
        chosen, logprobs = self.sampler.sample(logits, forbidden, [r.request.spec.temperature for r in rows])
        self.tokens_total += len(rows)
        for row, token, logprob in zip(rows, chosen, logprobs):
            row.token = token
            row.logprob_sum += logprob
            row.sampled.append(token)
            after_sampling(row.state, token, t.timestamp_begin, t.eot)
            if row.window == 0 and len(row.request.offsets) == 1:
                self._stream(row)

    def _stream(self, row: _Row) -> None:
        """The text of a one-window request as it decodes (whole characters only)."""
        text = self.whisper.decode_text(row.state.text_tokens)
        request = row.request
        if len(text) > len(request.streamed) and not text.endswith("\ufffd") and text.startswith(request.streamed):
            request.emit(TranscriptDelta(request.spec.request_id, text[len(request.streamed):]))
            request.streamed = text

    def _release_finished(self) -> None:
        index = 0
        while index < len(self._rows):
            row = self._rows[index]
            ended = (row.token == self.tokens.eot or len(row.sampled) >= self.max_sampled
                     or row.position >= self.dims.n_text_ctx or row.request.cancelled)
            if not ended:
                index += 1
                continue
            last = len(self._rows) - 1
            if index != last:  # the last active row takes this slot: active slots stay a prefix
                self.decoder.caches.move(last, index)
                self._rows[index] = self._rows[last]
            self._rows.pop()
            self._finish_window(row)

    def _finish_window(self, row: _Row) -> None:
        request = row.request
        offset, duration = request.offsets[row.window]
        tokens = [t for t in row.sampled if t != self.tokens.eot]
        request.results[row.window] = WindowResult(row.window, offset, duration, tokens,
                                                   row.logprob_sum / max(len(row.sampled), 1), row.no_speech_prob,
                                                   request.spec.temperature, self._words(row, tokens, duration))
        if request.cancelled:
            request.finished = True
        elif request.done:
            self._finish_request(request)

    def _words(self, row: _Row, tokens: list[int], duration: float) -> list:
        if row.features is None or row.request.cancelled:
            return []
        t, request = self.tokens, row.request
        sot_sequence = [t.sot, t.language_token(request.language),
                        t.transcribe if request.spec.task == "transcribe" else t.translate]
        text = [token for token in tokens if token < t.eot]
        return window_words(self.whisper, row.features, sot_sequence, text, request.language or "en", duration)

    def _finish_request(self, request: _Request) -> None:
        request.finished = True
        with self._lock:
            if request in self._requests:
                self._requests.remove(request)
        windows = [request.results[i] for i in sorted(request.results)]
        request.emit(TranscriptDone(request.spec.request_id, request.language or "en", windows,
                                    duration_s=len(request.spec.samples) / SAMPLE_RATE))

    def _fail_all(self, exc: Exception) -> None:
        rows, self._rows = self._rows, []
        failed = {id(row.request): row.request for row in rows}
        for request in failed.values():
            request.finished = request.cancelled = True  # its windows still waiting never start
            request.emit(TranscriptDone(request.spec.request_id, request.language or "", [], error=exc))


def taken_from(taken: list[tuple[_Request, int]], request: _Request) -> bool:
    return any(r is request for r, _ in taken)
