"""Remote images fetched by the ingress (issue 27), against a real HTTP server on 127.0.0.1: an image, redirect
chains, a slow answer, a slow trickle, oversize bodies (declared and not), wrong content types, errors; with
allow_remote_media on and off. The server is on 127.0.0.1, so fetching sets remote_media_allow_private (the hosts
refused without it: test_media_hosts.py)."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import replace
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from deployments.config import ModelConfig
from deployments.ingress_config import MediaLimits
from deployments.ingress.media_fetch import ImageLoader
from deployments.model_calls import ChatPrompt, ImageInput
from engine.errors import InvalidRequestError
from tests.support.serving import free_port
from tests.serve.local_stack import local_stack
from tests.support.images import png

RED, BLUE = png(4, 3), png(2, 2, (0, 0, 255))
LIMITS = MediaLimits(allow_remote_media=True, max_image_bytes=4096, remote_media_timeout_s=1.0,
                     remote_media_max_redirects=2, remote_media_allow_private=True)
BIG = png(256, 256, (1, 2, 3)) + bytes(8192)  # over LIMITS.max_image_bytes
# How long /slow and /trickle take to answer: far past LIMITS.remote_media_timeout_s, so a fetch cut at its time
# limit ends while their answer is still coming, however busy the machine.
SLOW_ANSWER_S = 10.0
TRICKLE_INTERVAL_S = 0.1


class ImageServer(BaseHTTPRequestHandler):
    """Paths: /red.png, /blue.png, /redirect/<n> (n hops to /red.png), /to-file, /slow, /trickle, /big (declared
    length), /big-chunked (no length), /page.html, /octets, /empty, /missing (404), /jpeg-with-params."""

    protocol_version = "HTTP/1.1"
    seen: ClassVar[list[str]] = []  # the paths asked for
    answered: ClassVar[list[str]] = []  # the paths whose answer the server has finished sending

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        self.seen.append(self.path)
        path = self.path
        if path in ("/red.png", "/blue.png"):
            self._answer(200, "image/png", RED if path == "/red.png" else BLUE)
        elif path.startswith("/redirect/"):
            hops = int(path.rsplit("/", 1)[1])
            self._redirect("/red.png" if hops <= 1 else f"/redirect/{hops - 1}")
        elif path == "/to-file":
            self._redirect("file:///etc/passwd")
        elif path == "/slow":
            time.sleep(SLOW_ANSWER_S)
            self._answer(200, "image/png", RED)
        elif path == "/trickle":  # every read arrives within the per-read timeout; the whole does not
            self._chunked_start("image/png")
            for _ in range(int(SLOW_ANSWER_S / TRICKLE_INTERVAL_S)):
                self._chunk(b"x")
                time.sleep(TRICKLE_INTERVAL_S)
            self._chunk(b"")
        elif path == "/big":
            self._answer(200, "image/png", BIG)
        elif path == "/big-chunked":
            self._chunked_start("image/png")
            for start in range(0, len(BIG), 1000):
                self._chunk(BIG[start:start + 1000])
            self._chunk(b"")
        elif path == "/page.html":
            self._answer(200, "text/html; charset=utf-8", b"<html></html>")
        elif path == "/octets":
            self._answer(200, "application/octet-stream", RED)
        elif path == "/empty":
            self._answer(200, "image/png", b"")
        elif path == "/jpeg-with-params":
            self._answer(200, "Image/JPEG; q=0.9", BLUE)
        else:
            self._answer(404, "text/plain", b"not here")
        self.answered.append(path)

    def _answer(self, status: int, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self._write(body)

    def _redirect(self, location: str) -> None:
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _chunked_start(self, content_type: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def _chunk(self, data: bytes) -> None:
        self._write(f"{len(data):x}\r\n".encode() + data + b"\r\n")

    def _write(self, data: bytes) -> None:
        try:
            self.wfile.write(data)
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client gave up (the limits under test)


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), ImageServer)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def load(urls: list[str], limits: MediaLimits = LIMITS) -> list[ImageInput]:
    images = [ImageInput(b"", f"messages.0.content.{i}", url=url) for i, url in enumerate(urls)]

    async def run() -> None:
        loader = ImageLoader(limits)
        try:
            await loader.load(ChatPrompt([{"role": "user", "content": [{"type": "image"}] * len(urls)}],
                                         images=images))
        finally:
            await loader.aclose()

    asyncio.run(run())
    return images


def refused(urls: list[str], limits: MediaLimits = LIMITS) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as caught:
        load(urls, limits)
    return caught.value


def test_images_are_fetched_with_their_content_type(server):
    red, blue, redirected, jpeg = load([f"{server}/red.png", f"{server}/blue.png", f"{server}/redirect/2",
                                        f"{server}/jpeg-with-params"])
    assert (red.data, red.media_type, red.url) == (RED, "image/png", f"{server}/red.png")
    assert (blue.data, redirected.data) == (BLUE, RED)
    assert (jpeg.data, jpeg.media_type) == (BLUE, "image/jpeg")


@pytest.mark.parametrize("path, words", [
    ("/redirect/3", "more than 2 redirects (remote_media_max_redirects)"),
    ("/to-file", "a redirect led to a URL that is not http(s)"),
    ("/missing", "the server answered 404"),
    ("/page.html", "content type is 'text/html', not an image type"),
    ("/octets", "'application/octet-stream', not an image type"),
    ("/empty", "the answer was empty"),
    ("/big", f"the image is {len(BIG):,} bytes; this server takes at most 4,096 bytes per image (max_image_bytes)"),
    ("/big-chunked", "the image is over 4,096 bytes; this server takes at most 4,096 bytes per image"),
    ("/slow", "it did not arrive within 1 s (remote_media_timeout_s)"),
    ("/trickle", "it did not arrive within 1 s (remote_media_timeout_s)"),
])
def test_failed_fetches_are_400s_naming_the_image(server, path, words):
    ImageServer.answered.clear()
    error = refused([f"{server}/red.png", f"{server}{path}"])
    assert error.param == "messages.0.content.1", error.message
    assert error.message.startswith("messages.0.content.1: the image "), error.message
    assert words in error.message, error.message
    if path in ("/slow", "/trickle"):  # the time limit is on the whole fetch: it holds for a trickle too
        assert path not in ImageServer.answered, "the fetch waited for the whole slow answer"


def test_unreachable_hosts_are_400s():
    error = refused([f"http://127.0.0.1:{free_port()}/a.png"])
    assert error.param == "messages.0.content.0" and "could not be fetched: ConnectError" in error.message


def test_nothing_is_fetched_unless_allowed(server):
    ImageServer.seen.clear()
    error = refused([f"{server}/red.png?sig=secret"], MediaLimits())
    assert error.param == "messages.0.content.0" and "'allow_remote_media: true'" in error.message
    assert f"({server}/red.png)" in error.message and "secret" not in error.message
    too_many = refused([f"{server}/red.png"] * 3, replace(LIMITS, max_images_per_request=2))
    assert too_many.message == "3 images; this server takes at most 2 per request (max_images_per_request)"
    assert ImageServer.seen == []


def test_remote_images_over_http_in_process(server, tiny_models):
    """Through the routes: refused when not allowed (fetching, or this loopback host); a failed fetch is a 400 in
    each API's shape. (A fetched image
    goes on to the model, whose side is checked with a vision model.)"""
    alpha = ModelConfig(model_id="tiny/alpha", model_path=str(tiny_models.alpha), context_length=512)
    missing = f"{server}/missing"
    chat = {"model": "tiny/alpha", "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": missing}}]}]}
    messages = {"model": "tiny/alpha", "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": missing}}]}]}
    responses = {"model": "tiny/alpha", "input": [
        {"role": "user", "content": [{"type": "input_image", "image_url": missing, "detail": "auto"}]}]}

    async def scenario(limits: MediaLimits) -> list:
        async with local_stack([alpha], media=limits) as stack:
            return [await stack.http.post("/v1/chat/completions", json=chat),
                    await stack.http.post("/v1/messages", json=messages),
                    await stack.http.post("/v1/messages/count_tokens", json=messages),
                    await stack.http.post("/v1/responses", json=responses)]

    public_only = replace(LIMITS, remote_media_allow_private=False)
    for limits, words in ((MediaLimits(), "allow_remote_media"), (LIMITS, "the server answered 404"),
                          (public_only, "the host 127.0.0.1 is a loopback address")):
        chat_answer, messages_answer, counted, responses_answer = asyncio.run(scenario(limits))
        for answer, param in ((chat_answer, "messages.0.content.0"), (responses_answer, "input[0].content[0]")):
            assert answer.status_code == 400, answer.text
            assert answer.json()["error"]["param"] == param and words in answer.json()["error"]["message"]
        for answer in (messages_answer, counted):
            assert answer.status_code == 400, answer.text
            error = answer.json()["error"]
            assert error["type"] == "invalid_request_error" and error["message"].startswith("messages.0.content.0: ")
            assert words in error["message"]
