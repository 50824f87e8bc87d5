"""Speech through the real graph (the session's shared graph on Ray Serve): a tiny random Whisper (model_type stt)
and the embedded voice (model_type tts), each its own application, reached by the `openai` client's
audio.transcriptions.create and audio.speech.create over HTTP, their events crossing Ray's handle stream; streamed
text equals the whole transcript, speech streams a sentence at a time; both listed with their types."""

from __future__ import annotations

import base64
import json

import pytest

from deployments.speech.audio_io import decode_audio
from tests.graph.shared_graph import SPEECH as MODEL
from tests.graph.shared_graph import VOICE
from tests.support.tiny_whisper import espeak_wav


@pytest.fixture(scope="module")
def hello(tmp_path_factory) -> bytes:
    return espeak_wav("hello world, this is a test of the speech server.", tmp_path_factory.mktemp("speech") / "h.wav")


def test_openai_transcriptions_through_ray(shared_graph, hello):
    client = shared_graph.openai(timeout=120)
    audio = ("hello.wav", hello, "audio/wav")
    whole = client.audio.transcriptions.create(model=MODEL, file=audio, language="en")
    verbose = client.audio.transcriptions.create(model=MODEL, file=audio, language="en",
                                                 response_format="verbose_json")
    with shared_graph.http(timeout=120) as http:
        streamed = http.post("/v1/audio/transcriptions", files={"file": audio},
                             data={"model": MODEL, "language": "en", "stream": "true"})
        listed = {m["id"]: m for m in http.get("/v1/admin/loaded-models").json()["data"]}
    assert whole.text and whole.text == verbose.text and verbose.language == "english"
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert events[-1]["type"] == "transcript.text.done" and events[-1]["text"] == whole.text
    assert "".join(e["delta"] for e in events[:-1]).strip() == whole.text
    assert listed[MODEL]["type"] == "stt" and listed[MODEL]["memory"]["total_mb"] > 0


def test_a_chat_model_refuses_audio_and_the_speech_model_refuses_chat(shared_graph, hello):
    from tests.graph.shared_graph import BETA

    with shared_graph.http(timeout=120) as http:
        audio_to_chat = http.post("/v1/audio/transcriptions", files={"file": ("h.wav", hello, "audio/wav")},
                                  data={"model": BETA})
        chat_to_audio = http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert audio_to_chat.status_code == 400 and "model_type stt" in audio_to_chat.json()["error"]["message"]
    assert chat_to_audio.status_code == 400 and "speech-to-text" in chat_to_audio.json()["error"]["message"]


def test_openai_speech_through_ray_streams_a_sentence_at_a_time(shared_graph):
    text = "Speech crosses the graph. It comes a sentence at a time. The last one ends here."
    client = shared_graph.openai(timeout=120)
    whole = client.audio.speech.create(model=VOICE, voice="alloy", input=text, response_format="mp3")
    with client.audio.speech.with_streaming_response.create(model=VOICE, voice="alloy", input=text,
                                                            response_format="mp3") as streamed:
        chunks = list(streamed.iter_bytes(chunk_size=None))
    with shared_graph.http(timeout=120) as http:
        events = http.post("/v1/audio/speech", json={"model": VOICE, "voice": "default", "input": text,
                                                     "response_format": "pcm", "stream_format": "sse"})
        listed = {m["id"]: m for m in http.get("/v1/admin/loaded-models").json()["data"]}
    assert 4.0 < decode_audio(whole.content, 60).seconds < 12.0
    assert len(chunks) >= 2 and 4.0 < decode_audio(b"".join(chunks), 60).seconds < 12.0  # sent as it was spoken
    payloads = [json.loads(line[6:]) for line in events.text.splitlines() if line.startswith("data: ")]
    assert [p["type"] for p in payloads] == ["speech.audio.delta"] * (len(payloads) - 1) + ["speech.audio.done"]
    pcm = b"".join(base64.b64decode(p["audio"]) for p in payloads[:-1])
    assert len(payloads) >= 4 and 4.0 < len(pcm) / 48_000 < 12.0  # three sentences, 24 kHz 16-bit
    assert listed[VOICE]["type"] == "tts" and listed[VOICE]["memory"]["total_mb"] > 0
