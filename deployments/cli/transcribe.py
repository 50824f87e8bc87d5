"""`orchard transcribe FILE`: a running server's transcript of an audio file (POST /v1/audio/transcriptions, or
/translations with --translate), printed as the server renders it; --stream prints the text as it is decoded."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import httpx

from deployments.cli.server_client import (
    ServerError, auth_headers, base_url, default_url, error_message, first_running_model,
)

FORMATS = ("text", "json", "verbose_json", "srt", "vtt")
# A long file is decoded window by window before its answer: the whole request may take minutes on a CPU.
TIMEOUT_S = 900.0


def add_parser(commands: argparse._SubParsersAction) -> None:
    transcribe = commands.add_parser("transcribe", help="transcribe an audio file with a running server's speech model")
    transcribe.add_argument("file", type=Path, help="audio in any format FFmpeg reads (wav, mp3, flac, m4a, ogg, ...)")
    transcribe.add_argument("--model", default=None, help="a speech model's id (default: the server's first stt model)")
    transcribe.add_argument("--url", default=None, help=f"server URL (default: $ORCHARD_URL or {default_url()})")
    transcribe.add_argument("--api-key", default=os.environ.get("ORCHARD_API_KEY"), help="default: $ORCHARD_API_KEY")
    transcribe.add_argument("--language", default=None, help="the speech's language, e.g. en (default: detected)")
    transcribe.add_argument("--prompt", default=None, help="text that precedes the audio (names, spelling)")
    transcribe.add_argument("--format", choices=FORMATS, default="text", dest="response_format")
    transcribe.add_argument("--translate", action="store_true", help="into English (/v1/audio/translations)")
    transcribe.add_argument("--stream", action="store_true", help="print the text as it is decoded (text format)")


def run(args: argparse.Namespace) -> int:
    try:
        url = base_url(args.url or default_url())
        audio = args.file.read_bytes()
    except (ValueError, OSError) as exc:
        print(f"orchard transcribe: {exc}", file=sys.stderr)
        return 2
    try:
        model = args.model or first_running_model(url, args.api_key, "stt", "default-stt")
        return _transcribe(args, url, model, audio)
    except ServerError as exc:
        print(f"orchard transcribe: {exc}", file=sys.stderr)
        return 1


def _transcribe(args: argparse.Namespace, url: str, model: str, audio: bytes) -> int:
    route = "translations" if args.translate else "transcriptions"
    fields = {"model": model, "response_format": args.response_format, "stream": str(args.stream).lower()}
    fields.update({k: v for k, v in (("language", args.language), ("prompt", args.prompt)) if v is not None})
    if args.translate:
        fields.pop("language", None)  # translations take none: the output is English
        fields.pop("stream")
    request = {"url": f"{url}/v1/audio/{route}", "data": fields, "files": {"file": (args.file.name, audio)},
               "headers": auth_headers(args.api_key), "timeout": TIMEOUT_S}
    try:
        with httpx.stream("POST", **request) as response:
            if response.status_code != 200:
                response.read()
                raise ServerError(error_message(response))
            if response.headers.get("content-type", "").startswith("text/event-stream"):
                return _print_events(response)
            response.read()
            print(_rendered(response, args.response_format), end="" if args.response_format in ("srt", "vtt") else "\n")
            return 0
    except httpx.HTTPError as exc:
        raise ServerError(f"no answer from {url} ({type(exc).__name__}: {exc})") from exc


def _rendered(response: httpx.Response, response_format: str) -> str:
    if response_format in ("json", "verbose_json"):
        return json.dumps(response.json(), indent=2, ensure_ascii=False)
    return response.text.rstrip("\n") if response_format == "text" else response.text


def _print_events(response: httpx.Response) -> int:
    """transcript.text.delta events as they come; transcript.text.done ends the line."""
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        event = json.loads(line[6:])
        if event.get("type") == "transcript.text.delta":
            print(event["delta"], end="", flush=True)
        elif event.get("type") == "transcript.text.done":
            print()
            return 0
        elif "error" in event:
            print()
            raise ServerError(event["error"].get("message", "the transcription failed"))
    raise ServerError("the stream ended before transcript.text.done")
