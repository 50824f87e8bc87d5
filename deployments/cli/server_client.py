"""How the `orchard` commands reach a running server: its base URL, whether it is this machine, its key, and
reads of /health and its models."""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx

DEFAULT_URL = "http://127.0.0.1:8000"
# The client's key for servers started with api_keys / ORCHARD_API_KEYS (the server's variable holds a list).
API_KEY_ENV = "ORCHARD_API_KEY"


class ServerError(Exception):
    """Something the user can act on, said in one message (no traceback)."""


class ServerUnreachable(Exception):
    """Nothing answers at the URL (refused, timed out, not HTTP)."""


@dataclass(frozen=True)
class ServedModel:
    id: str
    type: str  # "lm", "multimodal", "embedding"
    status: str  # "running", "loading", ...

    @property
    def chats(self) -> bool:
        return self.type != "embedding"


def default_url() -> str:
    """$ORCHARD_URL, else the server `orchard serve` runs on this machine (its --port), else DEFAULT_URL."""
    if "ORCHARD_URL" in os.environ:
        return os.environ["ORCHARD_URL"]
    try:
        return _server_url_file().read_text().strip() or DEFAULT_URL
    except OSError:
        return DEFAULT_URL


def orchard_home() -> Path:
    home = os.environ.get("ORCHARD_HOME")
    return Path(home) if home else Path.home() / ".cache" / "orchard"


def _server_url_file() -> Path:
    return orchard_home() / "run" / "server_url"


def record_server_url(url: str) -> None:
    """The URL of the server `orchard serve` runs, for the other commands' default."""
    path = _server_url_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(url + "\n")


def forget_server_url(url: str) -> None:
    """Remove the record if it is still this server's (another `orchard serve` may have taken over)."""
    try:
        if _server_url_file().read_text().strip() == url:
            _server_url_file().unlink()
    except OSError:
        pass


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
    """The key given, else $ORCHARD_API_KEY's; none when both are empty."""
    key = api_key if api_key is not None else os.environ.get(API_KEY_ENV, "")
    return {"Authorization": f"Bearer {key}"} if key else {}


def not_running_message(url: str) -> str:
    return f"no Orchard server answers at {url}: start one with `orchard serve` (or `serve run serve_config.yaml`)"


def unreachable_message(url: str, exc: httpx.HTTPError) -> str:
    return (f"no Orchard server answers at {url} ({type(exc).__name__}: {exc}). Start one with `orchard serve` "
            "(in another terminal), or pass --url.")


def server_health(url: str, api_key: str | None = None, timeout_s: float = 5.0) -> dict:
    """The body of GET /health (200 ok/degraded or 503 unhealthy both carry it); ServerError if nothing answers."""
    try:
        # /health is open to callers without a key, so $ORCHARD_API_KEY's going along changes nothing there
        response = httpx.get(f"{url}/health", headers=auth_headers(api_key), timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise ServerError(unreachable_message(url, exc)) from exc
    if response.status_code not in (200, 503):
        raise ServerError(f"{url}/health answered HTTP {response.status_code}: is this an Orchard server?")
    try:
        return response.json()
    except ValueError as exc:
        raise ServerError(f"{url}/health answered something that is not JSON: is this an Orchard server?") from exc


def server_readiness(url: str, timeout_s: float = 5.0) -> dict:
    """The body of GET /ready (200 ready or 503 not yet, both carry it: `ready`, `running`, `loading`, `failed`);
    ServerError if nothing answers (open to callers without a key, as /health)."""
    try:
        response = httpx.get(f"{url}/ready", timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise ServerError(unreachable_message(url, exc)) from exc
    if response.status_code not in (200, 503):
        raise ServerError(f"{url}/ready answered HTTP {response.status_code}: is this an Orchard server?")
    try:
        return response.json()
    except ValueError as exc:
        raise ServerError(f"{url}/ready answered something that is not JSON: is this an Orchard server?") from exc


def served_models(health: dict) -> list[ServedModel]:
    return [ServedModel(d["id"], d.get("type") or "lm", d.get("status") or "unknown")
            for d in health.get("models_detail", [])]


def error_message(response: httpx.Response) -> str:
    """The server's error body (OpenAI's shape) as one line, else the status."""
    try:
        error = response.json()["error"]
        return f"{error['message']} (HTTP {response.status_code})"
    except (ValueError, KeyError, TypeError):
        return f"HTTP {response.status_code}: {response.text[:200]}"


def first_running_model(url: str, api_key: str | None, model_type: str, embedded_path: str) -> str:
    """The id of the server's first running model of `model_type`; a ServerError saying how to load one if none."""
    running = [m.id for m in served_models(server_health(url, api_key))
               if m.type == model_type and m.status == "running"]
    if not running:
        raise ServerError(f"no {model_type} model runs at {url}: load one, e.g. `curl -X POST {url}/v1/admin/load-model "
                          f"-H 'content-type: application/json' -d '{{\"model_path\": \"{embedded_path}\"}}'`")
    return running[0]
