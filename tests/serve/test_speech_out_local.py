"""/v1/audio/speech over the in-process stack, with the `openai` client: the embedded Piper voice (real speech, every
response format, streamed events) and a tiny random Kitten served by mlx-audio (voices, speed); every bad request
answers a 400 naming its field."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import wave

import openai
import pytest

from deployments.config import DEFAULT_TTS_MODEL_ID, ModelConfig
from deployments.speech.audio_io import decode_audio
from tests.serve.local_stack import local_stack
from tests.support.tiny_kitten import VOICES, write_tiny_kitten

VOICE = DEFAULT_TTS_MODEL_ID
KITTEN = "kitten"
CHAT_MODEL_ID = "alpha"
SENTENCE = "Hello world, this is a test of the speech server."
FORMATS = {"mp3": "mp3", "opus": "ogg", "aac": "aac", "flac": "flac", "wav": "wav"}  # response_format -> container


@pytest.fixture(scope="module")
def kitten(tmp_path_factory):
    return write_tiny_kitten(tmp_path_factory.mktemp("tts") / "kitten")


def _configs(kitten, tiny_models) -> list[ModelConfig]:
    return [ModelConfig(model_path="default-tts"),
            ModelConfig(model_id=KITTEN, model_path=str(kitten), model_type="tts", max_speech_input_chars=300),
            ModelConfig(model_id=CHAT_MODEL_ID, model_path=str(tiny_models.alpha))]


def _client(stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://orchard/v1", api_key="unused", http_client=stack.http, max_retries=0)


def _pcm_seconds(data: bytes) -> float:
    return len(data) / 2 / 24_000  # OpenAI's pcm: 16-bit mono at 24 kHz


def test_every_format_with_the_openai_client(kitten, tiny_models):
    async def scenario():
        async with local_stack(_configs(kitten, tiny_models)) as stack:
            client = _client(stack)
            answers = {}
            for response_format in (*FORMATS, "pcm"):
                answer = await client.audio.speech.create(model=VOICE, voice="alloy", input=SENTENCE,
                                                          response_format=response_format)
                answers[response_format] = (answer.response.headers["content-type"], answer.content)
            return answers

    answers = asyncio.run(scenario())
    for response_format, container in FORMATS.items():
        media_type, data = answers[response_format]
        decoded = decode_audio(data, 60)
        assert decoded.source_format == container, response_format
        assert 1.5 < decoded.seconds < 6.0, (response_format, decoded.seconds)  # the sentence, spoken once
        assert media_type.startswith("audio/")
    with wave.open(io.BytesIO(answers["wav"][1])) as wav:  # a whole wav: its header holds the true length
        assert wav.getframerate() == 22_050 and wav.getnframes() * 2 + 44 == len(answers["wav"][1])
    assert answers["pcm"][0] == "audio/pcm" and 1.5 < _pcm_seconds(answers["pcm"][1]) < 6.0


def test_sse_streams_a_delta_per_sentence_then_the_usage(kitten, tiny_models):
    text = "The first sentence is short. The second one follows it. And a third ends the test."

    async def scenario():
        async with local_stack(_configs(kitten, tiny_models)) as stack:
            return await stack.http.post("/v1/audio/speech", json={
                "model": VOICE, "voice": "default", "input": text, "response_format": "pcm", "stream_format": "sse"})

    answer = asyncio.run(scenario())
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in answer.text.splitlines() if line.startswith("data: ")]
    deltas, done = events[:-1], events[-1]
    assert len(deltas) >= 3 and {e["type"] for e in deltas} == {"speech.audio.delta"}  # one or more per sentence
    audio = b"".join(base64.b64decode(e["audio"]) for e in deltas)
    seconds = _pcm_seconds(audio)
    assert done["type"] == "speech.audio.done" and 3.0 < seconds < 15.0
    usage = done["usage"]
    assert usage["input_tokens"] > len(text) and abs(usage["output_tokens"] - seconds * 50) <= 2
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


def test_an_mlx_audio_model_speaks_in_its_voices_at_the_asked_speed(kitten, tiny_models):
    async def scenario():
        async with local_stack(_configs(kitten, tiny_models)) as stack:
            client = _client(stack)

            async def pcm(voice, speed=1.0) -> bytes:
                answer = await client.audio.speech.create(model=KITTEN, voice=voice, input=SENTENCE, speed=speed,
                                                          response_format="pcm")
                return answer.content

            models = await client.models.list()
            return (await pcm(VOICES[0]), await pcm("alloy"), await pcm({"id": VOICES[1]}), await pcm(VOICES[0], 2.0),
                    {m.id: m for m in models.data})

    default, openai_named, second, fast, listed = asyncio.run(scenario())
    # OpenAI's voice names speak with the model's default voice: the same durations (its vocoder's noise differs).
    assert len(openai_named) == len(default)
    assert len(second) > 0  # a voice object names one of the model's own voices
    assert 0.3 < len(fast) / len(default) < 0.75  # twice the speed, about half the length
    assert KITTEN in listed and VOICE in listed


BAD_REQUESTS = [
    ({"voice": "nobody"}, "voice", "expr-voice-5-m"),
    ({"speed": 4.5}, "speed", None),
    ({"speed": 0.1}, "speed", None),
    ({"input": ""}, "input", None),
    ({"input": "   "}, "input", "no text"),
    ({"input": "word " * 61}, "input", "max_speech_input_chars (300)"),
    ({"response_format": "ogg"}, "response_format", None),
    ({"stream_format": "chunks"}, "stream_format", None),
    ({"model": CHAT_MODEL_ID}, "model", "model_type tts"),
]


def test_bad_requests_are_400s_naming_the_field(kitten, tiny_models):
    async def scenario():
        async with local_stack(_configs(kitten, tiny_models)) as stack:
            answers = []
            for fields, _, _ in BAD_REQUESTS:
                body = {"model": KITTEN, "voice": VOICES[0], "input": SENTENCE, **fields}
                answers.append(await stack.http.post("/v1/audio/speech", json=body))
            return answers

    for (fields, param, words), answer in zip(BAD_REQUESTS, asyncio.run(scenario())):
        assert answer.status_code == 400, (fields, answer.text)
        error = answer.json()["error"]
        assert error["param"] == param or param in error["message"], (fields, error)
        assert words is None or words in error["message"], (fields, error)


def test_the_voice_refuses_chat_and_transcription_and_takes_unknown_fields(kitten, tiny_models):
    async def scenario():
        async with local_stack(_configs(kitten, tiny_models)) as stack:
            chat = await stack.http.post("/v1/chat/completions", json={
                "model": KITTEN, "messages": [{"role": "user", "content": "hi"}]})
            heard = await stack.http.post("/v1/audio/transcriptions", data={"model": VOICE},
                                          files={"file": ("a.wav", b"RIFF0000WAVE", "audio/wav")})
            spoken = await stack.http.post("/v1/audio/speech", json={
                "model": VOICE, "voice": "alloy", "input": "Hi.", "instructions": "cheerfully", "future_field": 1})
            return chat, heard, spoken

    chat, heard, spoken = asyncio.run(scenario())
    assert chat.status_code == 400 and "/v1/audio/speech" in chat.json()["error"]["message"]
    assert heard.status_code == 400 and "model_type stt" in heard.json()["error"]["message"]
    assert spoken.status_code == 200 and spoken.headers["content-type"] == "audio/mpeg"
    assert decode_audio(spoken.content, 60).seconds > 0.2


def test_an_admin_load_takes_a_piper_voice_folder_under_the_model_roots(tmp_path):
    from engine.speech.piper_voice import piper_voice_file
    from engine.speech.voices import default_voice_path

    voice = piper_voice_file(default_voice_path())
    folder = tmp_path / "roots" / "my-voice"
    folder.mkdir(parents=True)
    for source in (voice, voice.with_name(voice.name + ".json")):
        (folder / source.name).symlink_to(source)
    (tmp_path / "roots" / "empty").mkdir()

    async def scenario():
        async with local_stack([], model_roots=[str(tmp_path / "roots")]) as stack:
            loaded = await stack.http.post("/v1/admin/load-model", json={
                "model_path": str(folder), "model_type": "tts"})
            empty = await stack.http.post("/v1/admin/load-model", json={
                "model_path": str(tmp_path / "roots" / "empty"), "model_type": "tts"})
            spoken = await stack.http.post("/v1/audio/speech", json={
                "model": "my-voice", "voice": "default", "input": "Loaded at run time.", "response_format": "flac"})
            return loaded, empty, spoken

    loaded, empty, spoken = asyncio.run(scenario())
    assert loaded.status_code == 200, loaded.text
    assert empty.status_code == 400 and "Piper voice" in empty.json()["error"]["message"]
    assert spoken.status_code == 200 and decode_audio(spoken.content, 60).source_format == "flac"
