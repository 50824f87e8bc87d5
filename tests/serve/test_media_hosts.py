"""Remote images only from public addresses (issue 48): loopback, unspecified, IPv4-mapped, private, link-local and
cloud metadata hosts are refused before any connection, at every redirect hop, unless remote_media_allow_private
(metadata never). Real httpx against real servers on 127.0.0.1 and ::1 that count the connections they accept;
names the system cannot resolve come from a resolver handed to the client (the one the check uses)."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from ipaddress import ip_address

import pytest

from deployments.ingress_config import IngressConfig, MediaLimits
from deployments.ingress.media_fetch import ImageLoader, fetch_images, new_http_client
from deployments.ingress.media_hosts import AddressRule, CheckedBackend, HostRefused, Resolver
from deployments.model_calls import ChatPrompt, ImageInput
from engine.errors import InvalidRequestError
from tests.support.images import png

RED = png(4, 3)
OFF = MediaLimits(allow_remote_media=True, remote_media_timeout_s=5.0)
ON = replace(OFF, remote_media_allow_private=True)
PUBLIC_ONLY = "this server fetches images from public addresses only (remote_media_allow_private)"
NEVER = ("cloud metadata addresses (169.254.0.0/16, fd00:ec2::254, fd00:ec2::23, 100.100.100.200) are never "
         "fetched")


class Handler(BaseHTTPRequestHandler):
    """/red.png, and /to?<location>: a 302 to that location."""

    server: CountingServer

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        self.server.seen.append(self.path)
        if self.path.startswith("/to?"):
            self.send_response(302)
            self.send_header("Location", self.path.removeprefix("/to?"))
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(RED)))
        self.end_headers()
        self.wfile.write(RED)


class CountingServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, host: str, family: socket.AddressFamily) -> None:
        self.address_family = family
        self.connections = 0  # accepted, whatever came over them
        self.seen: list[str] = []  # the paths asked for
        super().__init__((host, 0), Handler)

    def verify_request(self, request, client_address) -> bool:
        self.connections += 1
        return True


@dataclass
class Servers:
    v4: CountingServer
    v6: CountingServer | None  # None where ::1 cannot be bound


def serving(host: str, family: socket.AddressFamily) -> CountingServer:
    server = CountingServer(host, family)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def servers() -> Iterator[Servers]:
    v4 = serving("127.0.0.1", socket.AF_INET)
    try:
        v6 = serving("::1", socket.AF_INET6)
    except OSError:
        v6 = None
    yield Servers(v4, v6)
    for server in (v4, v6):
        if server is not None:
            server.shutdown()
            server.server_close()


def load(url: str, limits: MediaLimits) -> ImageInput:
    """Through the ingress's ImageLoader, as a route does."""
    image = ImageInput(b"", "messages.0.content.0", url=url)

    async def run() -> None:
        loader = ImageLoader(limits)
        try:
            await loader.load(ChatPrompt([{"role": "user", "content": [{"type": "image"}]}], images=[image]))
        finally:
            await loader.aclose()

    asyncio.run(run())
    return image


def fetch(url: str, limits: MediaLimits, names: dict[str, list[str]], asked: list[str]) -> ImageInput:
    """With a client whose resolver answers `names` (recording each name it is asked in `asked`)."""
    image = ImageInput(b"", "messages.0.content.0", url=url)

    async def resolver(host: str, port: int) -> list[str]:
        asked.append(host)
        return names[host]

    async def run(resolve: Resolver) -> None:
        client = new_http_client(limits, resolve)
        try:
            await fetch_images(client, [image], limits)
        finally:
            await client.aclose()

    asyncio.run(run(resolver))
    return image


def refusal(call, *args) -> str:
    with pytest.raises(InvalidRequestError) as caught:
        call(*args)
    assert caught.value.param == "messages.0.content.0", caught.value.message
    return caught.value.message


@pytest.mark.parametrize("url, on, words", [
    ("http://127.0.0.1:{port}/red.png", "v4", "the host 127.0.0.1 is a loopback address"),
    ("http://localhost:{port}/red.png", "v4", "the host localhost resolves to 127.0.0.1, a loopback address"),
    ("http://0.0.0.0:{port}/red.png", "v4", "the host 0.0.0.0 is the unspecified address"),
    ("http://[::ffff:127.0.0.1]:{port}/red.png", "v4",
     "the host ::ffff:127.0.0.1 is a form of 127.0.0.1, a loopback address"),
    ("http://[::1]:{port}/red.png", "v6", "the host ::1 is a loopback address"),
])
def test_loopback_hosts_are_refused_unless_private_is_allowed(servers, url, on, words):
    server = getattr(servers, on)
    if server is None:
        pytest.skip("::1 cannot be bound here")
    url = url.format(port=server.server_address[1])
    message = refusal(load, url, OFF)
    assert message == f"messages.0.content.0: the image at {url} could not be fetched: {words}: {PUBLIC_ONLY}"
    assert (server.connections, server.seen) == (0, [])
    # The same URL with private hosts allowed reaches the server: the check kept it out above, not the network.
    assert load(url, ON).data == RED and server.seen == ["/red.png"]


@pytest.mark.parametrize("url, words", [
    ("http://169.254.169.254/latest/meta-data", "the host 169.254.169.254 is a link-local address"),
    ("http://169.254.170.2/v2/credentials", "the host 169.254.170.2 is a link-local address"),
    ("http://[::ffff:169.254.169.254]/latest/meta-data",
     "the host ::ffff:169.254.169.254 is a form of 169.254.169.254, a link-local address"),
    ("http://[fd00:ec2::254]/latest/meta-data", "the host fd00:ec2::254 is a private address"),
    ("http://100.100.100.200/latest/meta-data", "the host 100.100.100.200 is a special-purpose address"),
])
def test_cloud_metadata_hosts_are_refused_even_with_private_allowed(url, words):
    assert refusal(load, url, OFF).endswith(f"could not be fetched: {words}: {PUBLIC_ONLY}")
    assert refusal(load, url, ON).endswith(f"could not be fetched: {words}: {NEVER}")


def test_a_redirect_hop_is_checked_like_the_first_url(servers):
    """Private hosts allowed: a server on 127.0.0.1 answers, and its redirect to a metadata host (by address or by a
    name) is refused with nothing sent there; a redirect to another name goes through the same resolver."""
    port = servers.v4.server_address[1]
    to_metadata = f"http://127.0.0.1:{port}/to?http://169.254.169.254/latest/meta-data"
    message = refusal(load, to_metadata, ON)
    assert message.endswith(f"the host 169.254.169.254 is a link-local address: {NEVER}"), message
    assert servers.v4.seen == ["/to?http://169.254.169.254/latest/meta-data"]

    names = {"images.test": ["127.0.0.1"], "metadata.test": ["169.254.169.254"], "other.test": ["127.0.0.1"]}
    asked: list[str] = []
    message = refusal(fetch, f"http://images.test:{port}/to?http://metadata.test/latest", ON, names, asked)
    assert message.endswith(f"the host metadata.test resolves to 169.254.169.254, a link-local address: {NEVER}")
    assert asked == ["images.test", "metadata.test"]

    asked.clear()
    image = fetch(f"http://images.test:{port}/to?http://other.test:{port}/red.png", ON, names, asked)
    assert image.data == RED and asked == ["images.test", "other.test"]


def test_the_connection_check_refuses_loopback_before_connecting(servers):
    """The check every hop's connection goes through (CheckedBackend.connect_tcp, called by httpcore for the first
    URL and for each redirect to a new origin), called as a redirect to 127.0.0.1 would call it."""
    port = servers.v4.server_address[1]
    backend = CheckedBackend(AddressRule())
    for host, words in (("127.0.0.1", "is a loopback address"), ("localhost", "resolves to 127.0.0.1")):
        with pytest.raises(HostRefused, match=words):
            asyncio.run(backend.connect_tcp(host, port, timeout=5.0))
    assert servers.v4.connections == 0


def test_a_name_with_any_refused_address_is_refused(servers):
    port = servers.v4.server_address[1]
    asked: list[str] = []
    message = refusal(fetch, f"http://mixed.test:{port}/red.png", OFF, {"mixed.test": ["8.8.8.8", "127.0.0.1"]},
                      asked)
    assert message.endswith(f"the host mixed.test resolves to 127.0.0.1, a loopback address: {PUBLIC_ONLY}")
    assert servers.v4.connections == 0


def test_the_connection_goes_to_the_address_checked(servers):
    """No second lookup between the check and the connect (DNS rebinding): a name only the check's resolver knows
    is fetched from the address it gave, resolved once."""
    port = servers.v4.server_address[1]
    asked: list[str] = []
    image = fetch(f"http://images.test:{port}/red.png", ON, {"images.test": ["127.0.0.1"]}, asked)
    assert image.data == RED and asked == ["images.test"] and servers.v4.seen == ["/red.png"]


def test_a_name_that_does_not_resolve_is_a_connect_error():
    message = refusal(load, "http://no-such-host.invalid/a.png", OFF)
    assert "could not be fetched: ConnectError: no-such-host.invalid: " in message, message


@pytest.mark.parametrize("address, off, on", [
    ("8.8.8.8", None, None),
    ("2606:4700:4700::1111", None, None),
    ("::ffff:8.8.8.8", None, None),
    ("64:ff9b::808:808", None, None),  # NAT64 of a public address (DNS64 on IPv6-only networks)
    ("10.1.2.3", "a private address", None),
    ("172.16.0.1", "a private address", None),
    ("192.168.1.1", "a private address", None),
    ("fc00::1", "a private address", None),
    ("fe80::1", "a link-local address", None),
    ("::", "the unspecified address", None),
    ("224.0.0.1", "a multicast address", None),
    ("ff0e::1", "a multicast address", None),
    ("240.0.0.1", "a reserved address", None),
    ("::7f00:1", "a reserved address", None),  # IPv4-compatible
    ("100.64.0.1", "a special-purpose address", None),  # carrier-grade NAT
    ("64:ff9b::a00:1", "a form of 10.0.0.1, a private address", None),
    ("2002:c0a8:101::1", "a form of 192.168.1.1, a private address", None),  # 6to4
    ("169.254.1.1", "a link-local address", "a link-local address"),
    ("::ffff:a9fe:a9fe", "a form of 169.254.169.254, a link-local address",
     "a form of 169.254.169.254, a link-local address"),
    ("fd00:ec2::23", "a private address", "a private address"),
])
def test_the_address_rule(address, off, on):
    assert AddressRule().refusal(ip_address(address)) == off
    assert AddressRule(allow_private=True).refusal(ip_address(address)) == on


def test_the_config_field():
    assert IngressConfig().media_limits().remote_media_allow_private is False
    assert IngressConfig(remote_media_allow_private=True).media_limits().remote_media_allow_private is True
    with pytest.raises(ValueError):
        IngressConfig(remote_media_allow_private="sometimes")
