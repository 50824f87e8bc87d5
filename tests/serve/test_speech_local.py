"""/v1/audio/transcriptions and /translations over the in-process stack, with the `openai` client: a tiny random
Whisper (the protocol: every response_format, streaming, errors) and espeak-ng speech."""

from __future__ import annotations

import asyncio
import json
import math

import numpy as np
import openai
import pytest

from deployments.config import ModelConfig
from deployments.speech.audio_io import decode_audio
from deployments.speech.audio_out import encode_audio
from tests.serve.local_stack import local_stack
from tests.support.tiny_whisper import espeak_wav, write_tiny_whisper

CHAT_MODEL_ID = "alpha"


@pytest.fixture(scope="module")
def speech(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("speech")
    return {"model": write_tiny_whisper(folder / "tiny-whisper", scale=4.0),
            "hello": espeak_wav("hello world, this is a test of the speech server.", folder / "hello.wav")}


def _configs(speech, tiny_models) -> list[ModelConfig]:
    return [ModelConfig(model_id="whisper", model_path=str(speech["model"]), model_type="stt"),
            ModelConfig(model_id=CHAT_MODEL_ID, model_path=str(tiny_models.alpha))]


def _client(stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://orchard/v1", api_key="unused", http_client=stack.http, max_retries=0)


def test_every_response_format_with_the_openai_client(speech, tiny_models):
    async def scenario():
        async with local_stack(_configs(speech, tiny_models)) as stack:
            client = _client(stack)
            audio = ("hello.wav", speech["hello"], "audio/wav")
            plain = await client.audio.transcriptions.create(model="whisper", file=audio, language="en")
            verbose = await client.audio.transcriptions.create(
                model="whisper", file=audio, language="en", response_format="verbose_json",
                timestamp_granularities=["segment"])
            text = await client.audio.transcriptions.create(model="whisper", file=audio, language="en",
                                                            response_format="text")
            srt = await client.audio.transcriptions.create(model="whisper", file=audio, response_format="srt")
            vtt = await client.audio.transcriptions.create(model="whisper", file=audio, response_format="vtt")
            translated = await client.audio.translations.create(model="whisper", file=audio)
            return plain, verbose, text, srt, vtt, translated

    plain, verbose, text, srt, vtt, translated = asyncio.run(scenario())
    assert plain.text and plain.text == verbose.text  # one transcript, however it is rendered
    assert verbose.language == "english" and 2.0 < verbose.duration < 6.0  # espeak's sentence
    assert plain.usage.type == "duration" and plain.usage.seconds == math.ceil(verbose.duration)
    assert verbose.segments and verbose.segments[0].start >= 0.0
    assert all(s.end >= s.start for s in verbose.segments)
    assert "".join(s.text for s in verbose.segments).strip() == verbose.text
    assert text.strip() == plain.text  # the SDK hands text formats back as str
    assert srt.startswith("1\n00:00:") and " --> " in srt and "," in srt.split("\n")[1]
    assert vtt.startswith("WEBVTT\n\n00:00:") and "." in vtt.split("\n")[2]
    assert isinstance(translated.text, str)


def test_word_timestamps_cover_the_text_in_order(speech, tiny_models):
    async def scenario():
        async with local_stack(_configs(speech, tiny_models)) as stack:
            client = _client(stack)
            audio = ("hello.wav", speech["hello"], "audio/wav")
            both = await client.audio.transcriptions.create(
                model="whisper", file=audio, language="en", response_format="verbose_json",
                timestamp_granularities=["word", "segment"])
            words_only = await client.audio.transcriptions.create(
                model="whisper", file=audio, language="en", response_format="verbose_json",
                timestamp_granularities=["word"])
            return both, words_only

    both, words_only = asyncio.run(scenario())
    assert both.words and both.segments and not getattr(words_only, "segments", None)
    assert [(w.word, w.start, w.end) for w in both.words] == [(w.word, w.start, w.end) for w in words_only.words]
    # Every character of the text, in order, in the words (the random model's text is no language: compared bare).
    assert "".join(w.word for w in both.words).replace(" ", "") == both.text.replace(" ", "")
    assert all(0.0 <= w.start <= w.end <= both.duration + 0.02 for w in both.words)
    assert all(a.start <= b.start for a, b in zip(both.words, both.words[1:]))


def test_streamed_text_equals_the_whole_transcript(speech, tiny_models):
    async def scenario():
        async with local_stack(_configs(speech, tiny_models)) as stack:
            files = {"file": ("hello.wav", speech["hello"], "audio/wav")}
            data = {"model": "whisper", "language": "en", "stream": "true"}
            streamed = await stack.http.post("/v1/audio/transcriptions", files=files, data=data)
            whole = await stack.http.post("/v1/audio/transcriptions", files=files, data={**data, "stream": "false"})
            return streamed, whole

    streamed, whole = asyncio.run(scenario())
    assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert [e["type"] for e in events[:-1]] == ["transcript.text.delta"] * (len(events) - 1)
    assert events[-1]["type"] == "transcript.text.done" and events[-1]["usage"]["seconds"] >= 2
    assert "".join(e["delta"] for e in events[:-1]).strip() == events[-1]["text"] == whole.json()["text"]


@pytest.mark.parametrize("files, data, param", [
    ({"file": ("x.wav", b"not audio at all", "audio/wav")}, {"model": "whisper"}, "file"),
    ({"file": ("x.wav", b"", "audio/wav")}, {"model": "whisper"}, "file"),
    (None, {"model": "whisper"}, "file"),
    ({"file": ("hello.wav", b"@hello", "audio/wav")}, {}, "model"),
    ({"file": ("hello.wav", b"@hello", "audio/wav")}, {"model": "whisper", "response_format": "mp3"}, "response_format"),
    ({"file": ("hello.wav", b"@hello", "audio/wav")}, {"model": "whisper", "temperature": "1.5"}, "temperature"),
    ({"file": ("hello.wav", b"@hello", "audio/wav")}, {"model": "whisper", "language": "klingon"}, "language"),
    ({"file": ("hello.wav", b"@hello", "audio/wav")},
     {"model": "whisper", "timestamp_granularities[]": "word", "response_format": "json"},
     "timestamp_granularities[]"),
    ({"file": ("hello.wav", b"@hello", "audio/wav")}, {"model": CHAT_MODEL_ID}, "model"),
])
def test_bad_requests_are_400s_naming_the_field(speech, tiny_models, files, data, param):
    if files is not None and files["file"][1] == b"@hello":
        files = {"file": ("hello.wav", speech["hello"], "audio/wav")}

    async def scenario():
        async with local_stack(_configs(speech, tiny_models)) as stack:
            if files is None:
                return await stack.http.post("/v1/audio/transcriptions", data=data)
            return await stack.http.post("/v1/audio/transcriptions", files=files, data=data)

    answer = asyncio.run(scenario())
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param, answer.text


def test_audio_past_the_models_limit_is_refused_naming_the_limit(speech, tmp_path):
    config = ModelConfig(model_id="whisper", model_path=str(speech["model"]), model_type="stt", max_audio_seconds=1)

    async def scenario():
        async with local_stack([config]) as stack:
            return await stack.http.post("/v1/audio/transcriptions", data={"model": "whisper"},
                                         files={"file": ("hello.wav", speech["hello"], "audio/wav")})

    answer = asyncio.run(scenario())
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "audio_too_long"
    assert "max_audio_seconds" in answer.json()["error"]["message"]


def test_a_long_file_streams_its_stitched_text_before_the_done_event(speech, tiny_models, tmp_path):
    """Three windows (70 s): the text is stitched once every window is decoded, then sent as a delta."""
    samples = decode_audio(speech["hello"], 60).samples
    long_audio = encode_audio(np.tile(samples, int(70 / (len(samples) / 16_000)) + 1)[:70 * 16_000], 16_000, "flac")

    async def scenario():
        async with local_stack(_configs(speech, tiny_models)) as stack:
            return await stack.http.post("/v1/audio/transcriptions", files={"file": ("long.flac", long_audio)},
                                         data={"model": "whisper", "language": "en", "stream": "true"})

    streamed = asyncio.run(scenario())
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert [e["type"] for e in events] == ["transcript.text.delta", "transcript.text.done"]
    assert events[0]["delta"] == events[1]["text"] and events[1]["usage"]["seconds"] == 70
