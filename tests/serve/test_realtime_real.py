"""A realtime transcription session with the embedded Whisper base, audio appended at the pace it is spoken: words
arrive while the speaker is still talking (those two passes in a row agreed on), and the completed event carries the
item decoded whole. Slow: a real model on the CPU.

A pass over the audio heard so far took 3.3 s on one 2-core machine and 6-8 s on another; a slower machine gets the
audio at a slower pace (its chunks further apart, the audio unchanged), so that three passes fit while it is spoken,
as on the faster one: the test is of the session's partial words, not of the machine's speed."""

from __future__ import annotations

import asyncio
import base64
import re
import time

import numpy as np
import openai
import pytest

from deployments.cli.local_server import LocalServer
from deployments.config import ModelConfig
from deployments.speech.audio_io import decode_audio
from deployments.speech.audio_out import encode_audio
from tests.support.tiny_whisper import espeak_wav

pytestmark = pytest.mark.slow
SAID = ("The weather in Paris is sunny today. My favorite color is green. Please send the report by Friday. "
        "The train leaves at seven in the morning. We planted tomatoes in the garden.")
CHUNK_S = 0.25
PASSES_WHILE_SPEAKING = 3.5  # passes that fit in the speech after its first 2 s (the first mostly guesses)


def test_partial_words_arrive_while_speaking_and_begin_the_final_transcript(tmp_path):
    samples = decode_audio(espeak_wav(SAID, tmp_path / "said.wav", words_per_minute=140), 60).samples
    pcm = encode_audio(np.interp(np.arange(len(samples) * 1.5) / 1.5, np.arange(len(samples)), samples), 24_000, "pcm")
    with LocalServer([ModelConfig(model_path="default-stt")]) as server:
        spoken_s = len(pcm) / 48_000
        pace = max(1.0, PASSES_WHILE_SPEAKING * _pass_seconds(server.url, pcm) / (spoken_s - 2.0))
        events = asyncio.run(_session(server.url, pcm, pace))
    kinds = [e.type for e in events]
    before_commit = kinds[:kinds.index("input_audio_buffer.committed")]
    assert "conversation.item.input_audio_transcription.delta" in before_commit, kinds  # words while speaking
    deltas = "".join(e.delta for e in events if e.type == "conversation.item.input_audio_transcription.delta")
    final = events[-1].transcript
    assert len(deltas.split()) >= 3, deltas
    heard = re.findall(r"[a-z]+", final.lower())
    assert sum(w in heard for w in ("paris", "green", "friday", "train", "tomatoes")) >= 4, final


def _pass_seconds(url: str, pcm: bytes) -> float:
    """One transcription of the whole clip, timed (the model warm): what a partial pass costs on this machine."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    wav = encode_audio(np.frombuffer(pcm, np.int16).astype(np.float32) / 32768, 24_000, "wav")
    client.audio.transcriptions.create(model="whisper-base", file=("warm.wav", wav))
    started = time.monotonic()
    client.audio.transcriptions.create(model="whisper-base", file=("said.wav", wav))
    return time.monotonic() - started


async def _session(url: str, pcm: bytes, pace: float) -> list:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    async with client.realtime.connect(extra_query={"intent": "transcription"}) as connection:
        await connection.recv()
        await connection.session.update(session={"type": "transcription", "audio": {"input": {
            "transcription": {"model": "whisper-base", "language": "en"}, "turn_detection": None}}})
        await connection.recv()
        events: list = []

        async def receive() -> None:
            while not events or events[-1].type != "conversation.item.input_audio_transcription.completed":
                events.append(await connection.recv())

        receiving = asyncio.create_task(receive())
        chunk = int(CHUNK_S * 48_000)
        for start in range(0, len(pcm), chunk):  # at the pace it was spoken
            await connection.input_audio_buffer.append(audio=base64.b64encode(pcm[start:start + chunk]).decode())
            await asyncio.sleep(CHUNK_S * pace)
        await connection.input_audio_buffer.commit()
        await asyncio.wait_for(receiving, 300)
    return events
