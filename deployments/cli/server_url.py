"""Where the server commands (top, bench) find a server: its base URL, whether it is this machine, its key."""

from __future__ import annotations

import ipaddress
import os
import socket
from urllib.parse import urlsplit

DEFAULT_URL = "http://127.0.0.1:8000"
# The client's key for servers started with api_keys / ORCHARD_API_KEYS (the server's variable holds a list).
API_KEY_ENV = "ORCHARD_API_KEY"


class ServerUnreachable(Exception):
    """Nothing answers at the URL (refused, timed out, not HTTP)."""


def base_url(url: str) -> str:
    """`http://host:port` without a trailing slash or a trailing /v1 (OpenAI clients' habit)."""
    url = url.strip().rstrip("/")
    url = url.removesuffix("/v1")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    return url


def is_loopback(url: str) -> bool:
    """True when every address the URL's host resolves to is a loopback one (127.0.0.0/8, ::1)."""
    host = urlsplit(url).hostname or ""
    try:
        infos = socket.getaddrinfo(host, None)
    except socket.gaierror:
        return False
    addresses = {info[4][0] for info in infos}
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def auth_headers(api_key: str | None) -> dict[str, str]:
    key = api_key if api_key is not None else os.environ.get(API_KEY_ENV, "")
    return {"Authorization": f"Bearer {key}"} if key else {}


def not_running_message(url: str) -> str:
    return f"no Orchard server answers at {url}: start one with `orchard serve` (or `serve run serve_config.yaml`)"
