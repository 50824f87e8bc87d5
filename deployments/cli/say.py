"""`orchard say TEXT -o out.wav`: a running server's speech of a text (POST /v1/audio/speech), written to a file (or
`-o -`: stdout) as it streams, in the format the file's extension names (.wav .mp3 .opus .ogg .aac .flac .pcm)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import BinaryIO

import httpx

from deployments.cli.server_client import (
    ServerError, auth_headers, base_url, default_url, error_message, first_running_model,
)

FORMATS = {".wav": "wav", ".mp3": "mp3", ".opus": "opus", ".ogg": "opus", ".aac": "aac", ".flac": "flac",
           ".pcm": "pcm"}
TIMEOUT_S = 600.0  # a long text is spoken a sentence at a time; the whole may take minutes on a busy CPU


def add_parser(commands: argparse._SubParsersAction) -> None:
    say = commands.add_parser("say", help="speak a text with a running server's text-to-speech model")
    say.add_argument("text", help="what to say ('-': read it from stdin)")
    say.add_argument("-o", "--output", required=True, help="the audio file to write ('-': stdout)")
    say.add_argument("--model", default=None, help="a tts model's id (default: the server's first tts model)")
    say.add_argument("--voice", default="default", help="one of the model's voices (default: its first)")
    say.add_argument("--speed", type=float, default=1.0, help="0.25 to 4 (default 1)")
    say.add_argument("--format", choices=sorted(set(FORMATS.values())), default=None, dest="response_format",
                     help="default: from the output's extension, else wav")
    say.add_argument("--url", default=None, help=f"server URL (default: $ORCHARD_URL or {default_url()})")
    say.add_argument("--api-key", default=os.environ.get("ORCHARD_API_KEY"), help="default: $ORCHARD_API_KEY")


def run(args: argparse.Namespace) -> int:
    try:
        url = base_url(args.url or default_url())
        text = sys.stdin.read() if args.text == "-" else args.text
    except (ValueError, OSError) as exc:
        print(f"orchard say: {exc}", file=sys.stderr)
        return 2
    response_format = args.response_format or FORMATS.get(Path(args.output).suffix.lower(), "wav")
    try:
        model = args.model or first_running_model(url, args.api_key, "tts", "default-tts")
        body = {"model": model, "input": text, "voice": args.voice, "speed": args.speed,
                "response_format": response_format}
        written = _speak(url, args.api_key, body, args.output)
    except ServerError as exc:
        print(f"orchard say: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"orchard say: {exc}", file=sys.stderr)
        return 2
    if args.output != "-":
        print(f"{args.output}: {written} bytes of {response_format} from {model}", file=sys.stderr)
    return 0


def _speak(url: str, api_key: str | None, body: dict, output: str) -> int:
    try:
        with httpx.stream("POST", f"{url}/v1/audio/speech", json=body, headers=auth_headers(api_key),
                          timeout=TIMEOUT_S) as response:
            if response.status_code != 200:
                response.read()
                raise ServerError(error_message(response))
            if output == "-":
                return _copied(response, sys.stdout.buffer)
            partial = Path(f"{output}.partial")  # a broken stream leaves no file that looks whole
            try:
                with partial.open("wb") as file:
                    written = _copied(response, file)
            except BaseException:
                partial.unlink(missing_ok=True)
                raise
            partial.replace(output)
            return written
    except httpx.HTTPError as exc:
        raise ServerError(f"the speech did not arrive whole from {url} ({type(exc).__name__}: {exc})") from exc


def _copied(response: httpx.Response, file: BinaryIO) -> int:
    written = 0
    for chunk in response.iter_bytes():
        file.write(chunk)
        written += len(chunk)
    file.flush()
    return written
