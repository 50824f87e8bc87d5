"""`orchard transcribe FILE` and `orchard say TEXT -o FILE` against a server on a loopback port (the in-process
ingress, a tiny random Whisper, the embedded voice): what they print or write is the server's own answer (plain,
streamed, as subtitles; the voice's audio in the file's format), and their failures are one line and an exit status."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from deployments.cli.local_server import LocalServer
from deployments.config import DEFAULT_TTS_MODEL_ID, ModelConfig
from deployments.speech.audio_io import decode_audio
from tests.support.tiny_whisper import espeak_wav, write_tiny_whisper

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def speech(tmp_path_factory, tiny_models):
    folder = tmp_path_factory.mktemp("cli-speech")
    whisper = write_tiny_whisper(folder / "tiny-whisper", scale=4.0)
    wav = folder / "hello.wav"
    espeak_wav("hello world, this is a test of the speech server.", wav)
    configs = [ModelConfig(model_id="alpha", model_path=str(tiny_models.alpha)),
               ModelConfig(model_id="whisper", model_path=str(whisper), model_type="stt"),
               ModelConfig(model_path="default-tts")]
    with LocalServer(configs) as running:
        yield running, wav


def orchard(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deployments.cli.main", *args], capture_output=True, text=True,
                          cwd=REPO, env={**os.environ, "NO_COLOR": "1"}, timeout=120, check=False)


def served(server: LocalServer, wav: Path, **fields: str) -> httpx.Response:
    answer = httpx.post(f"{server.url}/v1/audio/transcriptions", data={"model": "whisper", **fields},
                        files={"file": (wav.name, wav.read_bytes())}, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer


def test_it_prints_the_servers_transcript_plain_streamed_and_as_subtitles(speech):
    server, wav = speech
    expected = served(server, wav, language="en").json()["text"]
    assert expected  # the tiny model says something
    plain = orchard("transcribe", str(wav), "--url", server.url, "--language", "en")  # its stt model found alone
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout == expected + "\n"
    streamed = orchard("transcribe", str(wav), "--url", server.url, "--language", "en", "--stream")
    assert streamed.returncode == 0 and streamed.stdout.strip() == expected.strip()
    srt = orchard("transcribe", str(wav), "--url", server.url, "--model", "whisper", "--format", "srt")
    assert srt.returncode == 0 and srt.stdout == served(server, wav, response_format="srt").text


def test_failures_are_one_line_and_an_exit_status(speech, tmp_path):
    server, wav = speech
    missing = orchard("transcribe", str(tmp_path / "none.wav"), "--url", server.url)
    assert missing.returncode == 2 and "none.wav" in missing.stderr
    chat_model = orchard("transcribe", str(wav), "--url", server.url, "--model", "alpha")
    assert chat_model.returncode == 1 and "(HTTP 400)" in chat_model.stderr and "Traceback" not in chat_model.stderr
    garbage = tmp_path / "noise.wav"
    garbage.write_bytes(b"not audio at all")
    unreadable = orchard("transcribe", str(garbage), "--url", server.url)
    assert unreadable.returncode == 1 and "(HTTP 400)" in unreadable.stderr


def test_say_writes_the_voices_audio_in_the_files_format_and_transcribe_reads_it(speech, tmp_path):
    server, _ = speech
    for name, container in (("hello.wav", "wav"), ("hello.mp3", "mp3"), ("hello.ogg", "ogg")):
        said = orchard("say", "Hello there. This is the command line.", "-o", str(tmp_path / name), "--url", server.url)
        assert said.returncode == 0, said.stderr
        assert f"from {DEFAULT_TTS_MODEL_ID}" in said.stderr  # its tts model found alone
        decoded = decode_audio((tmp_path / name).read_bytes(), 60)
        assert decoded.source_format == container and 1.0 < decoded.seconds < 8.0
    heard = orchard("transcribe", str(tmp_path / "hello.mp3"), "--url", server.url, "--language", "en")
    assert heard.returncode == 0 and heard.stdout.strip()  # the tiny Whisper hears something in the voice's mp3
    raw = subprocess.run([sys.executable, "-m", "deployments.cli.main", "say", "Hello there, my friend.", "-o", "-", "--format", "pcm",
                          "--url", server.url], capture_output=True, cwd=REPO, timeout=120, check=False)
    assert raw.returncode == 0 and len(raw.stdout) > 24_000 and len(raw.stdout) % 2 == 0  # pcm: 24 kHz, 16-bit


def test_say_failures_are_one_line_and_leave_no_file(speech, tmp_path):
    server, _ = speech
    unknown_voice = orchard("say", "Hi.", "-o", str(tmp_path / "a.wav"), "--url", server.url, "--voice", "nobody")
    assert unknown_voice.returncode == 1 and "(HTTP 400)" in unknown_voice.stderr and "nobody" in unknown_voice.stderr
    chat_model = orchard("say", "Hi.", "-o", str(tmp_path / "b.wav"), "--url", server.url, "--model", "alpha")
    assert chat_model.returncode == 1 and "model_type tts" in chat_model.stderr
    assert "Traceback" not in unknown_voice.stderr + chat_model.stderr and not list(tmp_path.iterdir())
