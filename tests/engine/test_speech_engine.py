"""The speech engine on a tiny random Whisper (mlx-audio's architecture, Whisper's vocabulary): its batched decoder
equals mlx-audio's own, and a window decodes the same tokens batched with others as alone."""

from __future__ import annotations

import queue

import mlx.core as mx
import pytest

from deployments.speech.audio_io import decode_audio
from engine.speech.batch_decoder import BatchDecoder
from engine.speech.requests import TranscriptDelta, TranscriptDone, TranscriptionRequest
from engine.speech.speech_engine import SpeechEngine
from engine.speech.whisper_model import load_whisper, window_mel
from tests.support.tiny_whisper import espeak_wav, write_tiny_whisper


@pytest.fixture(scope="module")
def whisper(tmp_path_factory):
    return load_whisper(write_tiny_whisper(tmp_path_factory.mktemp("whisper") / "tiny", scale=4.0), mx.float32)


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    """Three spoken sentences of different lengths, 16 kHz mono float32."""
    folder = tmp_path_factory.mktemp("speech")
    texts = ["hello world", "the quick brown fox jumps over the lazy dog", "one two three four five six"]
    return [decode_audio(espeak_wav(t, folder / f"{i}.wav"), 60).samples for i, t in enumerate(texts)]


def test_the_batched_decoder_equals_mlx_audios_own(whisper, clips):
    """Prefill then steps on slot 1 of 3 (the others holding other windows) give mlx-audio's decoder's logits."""
    decoder = BatchDecoder(whisper.model, 3, mx.float32)
    audio = decoder.encode(mx.stack([window_mel(c, 80) for c in clips]))
    for slot in range(3):
        decoder.admit(slot, audio[slot])
    t = whisper.tokens
    prompt = [t.sot, t.language_token("en"), t.transcribe]
    ours = [decoder.prefill(slot, prompt, 0)[-1] for slot in range(3)]
    fed = [list(prompt) for _ in range(3)]
    for _ in range(5):
        tokens = [int(mx.argmax(logits).item()) for logits in ours]
        for slot in range(3):
            fed[slot].append(tokens[slot])
        ours = list(decoder.step(tokens, [len(f) - 1 for f in fed]))
    for slot in range(3):
        reference = whisper.model.decoder(mx.array(fed[slot])[None], audio[slot:slot + 1])[0][0, -1]
        assert mx.abs(ours[slot] - reference).max().item() < 1e-3, slot


def _transcribe(engine: SpeechEngine, requests: list[TranscriptionRequest]) -> dict[str, tuple[TranscriptDone, str]]:
    events: queue.Queue = queue.Queue()
    for request in requests:
        engine.submit(request, events.put)
    done: dict[str, TranscriptDone] = {}
    streamed: dict[str, str] = {r.request_id: "" for r in requests}
    while len(done) < len(requests):
        event = events.get(timeout=120)
        if isinstance(event, TranscriptDelta):
            streamed[event.request_id] += event.text
        else:
            done[event.request_id] = event
    return {rid: (done[rid], streamed[rid]) for rid in done}


def test_a_window_decodes_the_same_batched_as_alone(whisper, clips):
    engine = SpeechEngine(whisper, slots=4, encode_batch=4)
    engine.start()
    try:
        requests = [TranscriptionRequest(f"r{i}", clip, language="en") for i, clip in enumerate(clips)]
        together = _transcribe(engine, requests)
        alone = {r.request_id: _transcribe(engine, [r])[r.request_id] for r in requests}
    finally:
        engine.stop()
    for rid in together:
        (batched, batched_text), (single, single_text) = together[rid], alone[rid]
        assert batched.error is None and single.error is None
        assert [w.tokens for w in batched.windows] == [w.tokens for w in single.windows], rid
        assert batched.windows[0].avg_logprob == pytest.approx(single.windows[0].avg_logprob, abs=1e-4)
        assert batched_text == single_text  # streamed text too
        assert len(batched.windows[0].tokens) > 0
