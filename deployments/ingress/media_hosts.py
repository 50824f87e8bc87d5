"""Which hosts remote images may come from (issue 48): public addresses only, unless the operator allows private ones.

The check sits where connections are made: the image client's network backend resolves each host it connects to
(the first URL's and every redirect's), refuses the host if any of its addresses is refused, and connects to the
very addresses it checked. Checking and connecting on one resolution closes DNS rebinding (a name answering a public
address to a check and a private one to the connect that follows). The client uses no proxy from the environment,
as a proxy would resolve names itself, past this check.
"""

from __future__ import annotations

import asyncio
import socket
import typing
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network, ip_address

import httpcore
import httpx

IPAddress = IPv4Address | IPv6Address
Resolver = Callable[[str, int], Awaitable[list[str]]]  # (host, port) -> its addresses, as strings

_PRIVATE = (IPv4Network("10.0.0.0/8"), IPv4Network("172.16.0.0/12"), IPv4Network("192.168.0.0/16"),
            IPv6Network("fc00::/7"))
_NAT64 = IPv6Network("64:ff9b::/96")
# Where clouds serve instance metadata and credentials (169.254.169.254 on AWS, GCP, Azure, Oracle; ECS and EKS
# on 169.254.170.x; AWS over IPv6; Alibaba): refused even with remote_media_allow_private.
_METADATA_NETWORK = IPv4Network("169.254.0.0/16")
_METADATA_ADDRESSES = frozenset(ip_address(a) for a in ("fd00:ec2::254", "fd00:ec2::23", "100.100.100.200"))
METADATA_SHOWN = "169.254.0.0/16, fd00:ec2::254, fd00:ec2::23, 100.100.100.200"


class HostRefused(Exception):
    """A remote image's host is one this server does not connect to. Never reaches HTTP itself: media_fetch makes
    it a 400 naming the image."""


@dataclass(frozen=True)
class AddressRule:
    """Public addresses only; with `allow_private`, any address but the cloud metadata ones."""

    allow_private: bool = False

    def refusal(self, ip: IPAddress) -> str | None:
        """What `ip` is where the rule refuses it ("a loopback address"); None where it is allowed."""
        inner = embedded_ipv4(ip)
        if inner is not None:  # an IPv6 form that reaches an IPv4 host is judged by that host
            why = self.refusal(inner)
            return None if why is None else f"a form of {inner}, {why}"
        if ip in _METADATA_ADDRESSES or (isinstance(ip, IPv4Address) and ip in _METADATA_NETWORK):
            return address_kind(ip) or "a cloud metadata address"
        return None if self.allow_private else address_kind(ip)

    def explained(self) -> str:
        """The rule, for a refusal's message."""
        if self.allow_private:
            return f"cloud metadata addresses ({METADATA_SHOWN}) are never fetched"
        return "this server fetches images from public addresses only (remote_media_allow_private)"


def embedded_ipv4(ip: IPAddress) -> IPv4Address | None:
    """The IPv4 address an IPv6 one stands for: IPv4-mapped (::ffff:a.b.c.d), NAT64 (64:ff9b::a.b.c.d), 6to4."""
    if not isinstance(ip, IPv6Address):
        return None
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip in _NAT64:
        return IPv4Address(int(ip) & 0xFFFF_FFFF)
    return ip.sixtofour


def address_kind(ip: IPAddress) -> str | None:
    """What a non-public address is, for messages; None for a public one."""
    if ip.is_unspecified:
        return "the unspecified address"
    if ip.is_loopback:
        return "a loopback address"
    if ip.is_link_local:
        return "a link-local address"
    if ip.is_multicast:  # ipaddress calls multicast global
        return "a multicast address"
    if any(ip.version == net.version and ip in net for net in _PRIVATE):
        return "a private address"
    if ip.is_reserved:  # IPv4-compatible IPv6 (::a.b.c.d) among others, which ipaddress calls global
        return "a reserved address"
    return None if ip.is_global else "a special-purpose address"


async def resolve(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


async def checked_addresses(host: str, port: int, rule: AddressRule, resolver: Resolver) -> list[str]:
    """`host`'s addresses once every one is allowed; HostRefused naming the first that is not."""
    literal = _is_address(host)
    addresses = [host] if literal else await resolver(host, port)
    for address in addresses:
        what = rule.refusal(ip_address(address))
        if what is not None:
            said = f"is {what}" if literal else f"resolves to {address}, {what}"
            raise HostRefused(f"the host {host} {said}: {rule.explained()}")
    return addresses


def _is_address(host: str) -> bool:
    try:
        ip_address(host)
    except ValueError:
        return False
    return True


class CheckedBackend(httpcore.AsyncNetworkBackend):
    """httpcore's network backend, connecting only to addresses the rule allows and to those it checked."""

    def __init__(self, rule: AddressRule, resolver: Resolver = resolve) -> None:
        self.rule = rule
        self._resolve = resolver
        self._inner = httpcore.AnyIOBackend()

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                          socket_options: typing.Iterable[typing.Any] | None = None) -> httpcore.AsyncNetworkStream:
        try:
            addresses = await checked_addresses(host, port, self.rule, self._resolve)
        except socket.gaierror as exc:  # what httpx says of a name that does not resolve
            raise httpcore.ConnectError(f"{host}: {exc}") from exc
        failed: Exception = httpcore.ConnectError(f"{host} has no address")
        for address in addresses:  # each in turn, as getaddrinfo ordered them
            try:
                return await self._inner.connect_tcp(address, port, timeout, local_address, socket_options)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                failed = exc
        raise failed

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: typing.Iterable[typing.Any] | None = None
                                  ) -> httpcore.AsyncNetworkStream:
        raise HostRefused("a Unix socket is never fetched from")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


class CheckedTransport(httpx.AsyncHTTPTransport):
    """httpx's transport (no proxy) over a CheckedBackend."""

    def __init__(self, rule: AddressRule, resolver: Resolver = resolve) -> None:
        ssl_context = httpx.create_ssl_context()
        super().__init__(verify=ssl_context)
        # httpx takes no network backend, so its pool is replaced by one with ours; a renamed attribute would
        # leave connections unchecked, hence the check.
        if not isinstance(getattr(self, "_pool", None), httpcore.AsyncConnectionPool):
            raise RuntimeError("httpx's AsyncHTTPTransport keeps its pool elsewhere: media_hosts.py needs a change")
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=ssl_context, max_connections=100, max_keepalive_connections=20, keepalive_expiry=5.0,
            network_backend=CheckedBackend(rule, resolver))
