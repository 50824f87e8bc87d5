"""Realtime transcription sessions (wss /v1/realtime?intent=transcription) against a loopback server (the in-process
ingress, a tiny random Whisper), through the `openai` SDK's realtime client: an item committed by the client, or by
server_vad at the end of speech, is transcribed as the same audio uploaded whole is; bad events are error events;
the session needs the API key where keys are set."""

from __future__ import annotations

import base64
import io
import json
import wave

import numpy as np
import openai
import pytest
import websockets.sync.client

from deployments.cli.local_server import LocalServer
from deployments.config import ModelConfig
from deployments.speech.audio_io import decode_audio
from deployments.speech.audio_out import encode_audio
from tests.support.tiny_whisper import espeak_wav, write_tiny_whisper

KEY = "realtime-test-key"
SESSION = {"type": "transcription", "audio": {"input": {
    "transcription": {"model": "whisper", "language": "en"}, "turn_detection": None}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("realtime")
    whisper = write_tiny_whisper(folder / "tiny-whisper", scale=4.0)
    with LocalServer([ModelConfig(model_id="whisper", model_path=str(whisper), model_type="stt")],
                     inference_keys=[KEY]) as running:
        yield running


@pytest.fixture(scope="module")
def pcm(tmp_path_factory) -> bytes:
    """A spoken sentence as OpenAI's realtime audio: 16-bit mono at 24 kHz."""
    wav = espeak_wav("hello world, this is a test of the speech server.", tmp_path_factory.mktemp("pcm") / "h.wav")
    samples = decode_audio(wav, 60).samples  # 16 kHz float
    return encode_audio(np.interp(np.arange(len(samples) * 1.5) / 1.5, np.arange(len(samples)), samples), 24_000,
                        "pcm")


def _client(server: LocalServer, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)


def _events_until(connection, last: str) -> list:
    events = []
    while not events or events[-1].type != last:
        events.append(connection.recv())
    return events


def _uploaded_text(server: LocalServer, pcm: bytes) -> str:
    import httpx

    out = io.BytesIO()
    with wave.open(out, "wb") as file:  # the very samples the session received
        file.setnchannels(1)
        file.setsampwidth(2)
        file.setframerate(24_000)
        file.writeframes(pcm)
    wav = out.getvalue()
    answer = httpx.post(f"{server.url}/v1/audio/transcriptions", headers={"Authorization": f"Bearer {KEY}"},
                        data={"model": "whisper", "language": "en"}, files={"file": ("a.wav", wav)}, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()["text"]


def test_a_committed_item_is_transcribed_as_the_same_audio_uploaded(server, pcm):
    with _client(server).realtime.connect(extra_query={"intent": "transcription"}) as connection:
        created = connection.recv()
        connection.session.update(session=SESSION)
        updated = connection.recv()
        for start in range(0, len(pcm), 9600):  # 0.2 s appends, as a microphone sends them
            connection.input_audio_buffer.append(audio=base64.b64encode(pcm[start:start + 9600]).decode())
        connection.input_audio_buffer.commit()
        events = _events_until(connection, "conversation.item.input_audio_transcription.completed")
    assert created.type == "session.created" and updated.type == "session.updated"
    assert updated.session.audio.input.transcription.model == "whisper"
    committed = [e for e in events if e.type == "input_audio_buffer.committed"]
    completed = events[-1]
    assert len(committed) == 1 and committed[0].item_id == completed.item_id and committed[0].previous_item_id is None
    assert completed.transcript == _uploaded_text(server, pcm)  # the same audio, the same transcript
    assert completed.usage.type == "duration" and abs(completed.usage.seconds - len(pcm) / 48_000) < 0.01
    deltas = "".join(e.delta for e in events if e.type == "conversation.item.input_audio_transcription.delta")
    assert completed.transcript.startswith(deltas.strip())  # partial text is never taken back


def test_server_vad_cuts_items_at_the_silence_after_speech(server, pcm):
    silence = bytes(48_000)  # 1 s
    session = {"type": "transcription", "audio": {"input": {"transcription": {"model": "whisper", "language": "en"},
                                                            "turn_detection": {"type": "server_vad"}}}}
    with _client(server).realtime.connect(extra_query={"intent": "transcription"}) as connection:
        connection.recv()
        connection.session.update(session=session)
        connection.recv()
        for chunk in (silence, pcm, silence, pcm, silence):
            connection.input_audio_buffer.append(audio=base64.b64encode(chunk).decode())
        first = _events_until(connection, "conversation.item.input_audio_transcription.completed")
        second = _events_until(connection, "conversation.item.input_audio_transcription.completed")
    kinds = [e.type for e in first + second]
    assert kinds.count("input_audio_buffer.speech_started") == 2 and kinds.count("input_audio_buffer.committed") == 2
    started = [e for e in first + second if e.type == "input_audio_buffer.speech_started"]
    assert 500 <= started[0].audio_start_ms <= 1000  # after the first second of silence, less its padding
    committed = [e for e in first + second if e.type == "input_audio_buffer.committed"]
    assert committed[1].previous_item_id == committed[0].item_id
    # The same sentence twice: two items of its length, with 300 ms of padding before and 500 ms of silence after.
    spoken_s = len(pcm) / 48_000
    seconds = [first[-1].usage.seconds, second[-1].usage.seconds]
    assert abs(seconds[0] - seconds[1]) < 0.05 and all(spoken_s - 0.5 < s < spoken_s + 0.85 for s in seconds)
    assert first[-1].transcript and second[-1].transcript


def test_bad_events_are_error_events_and_the_session_goes_on(server, pcm):
    url = server.url.replace("http://", "ws://") + "/v1/realtime?intent=transcription"
    with websockets.sync.client.connect(url, additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
        created = json.loads(ws.recv())
        answers = []
        for event in ({"type": "input_audio_buffer.append", "audio": "%%%", "event_id": "e1"},
                      {"type": "input_audio_buffer.append", "audio": base64.b64encode(b"abc").decode()},
                      {"type": "input_audio_buffer.commit"},
                      {"type": "response.create"},
                      {"type": "session.update", "session": {"audio": {"input": {"format": {"rate": 16000}}}}},
                      "not json"):
            ws.send(event if isinstance(event, str) else json.dumps(event))
            answers.append(json.loads(ws.recv()))
        ws.send(json.dumps({"type": "session.update", "session": SESSION}))
        still_open = json.loads(ws.recv())
    assert created["type"] == "session.created"
    assert [a["type"] for a in answers] == ["error"] * 6
    assert answers[0]["error"]["event_id"] == "e1" and answers[0]["error"]["param"] == "audio"
    assert "even number of bytes" in answers[1]["error"]["message"]
    assert "empty" in answers[2]["error"]["message"] and "response.create" in answers[3]["error"]["message"]
    assert "rate" in answers[4]["error"]["param"]
    assert still_open["type"] == "session.updated"


def test_the_session_needs_the_key_and_the_transcription_intent(server):
    with pytest.raises(Exception) as refused:  # the SDK's websocket library refuses the 403 handshake
        with _client(server, key="wrong").realtime.connect(extra_query={"intent": "transcription"}) as connection:
            connection.recv()
    assert "403" in str(refused.value)
    url = server.url.replace("http://", "ws://") + "/v1/realtime?model=whisper"
    with websockets.sync.client.connect(url, additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
        error = json.loads(ws.recv())
        with pytest.raises(websockets.exceptions.ConnectionClosed) as closed:
            ws.recv()
    assert error["type"] == "error" and "intent=transcription" in error["error"]["message"]
    assert closed.value.rcvd.code == 1008
