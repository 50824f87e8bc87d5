"""A small HTTP client for the `orchard` commands that talk to a running server: /health and its models."""

from __future__ import annotations

import os
from dataclasses import dataclass

import httpx

DEFAULT_URL = "http://127.0.0.1:8000"


class ServerError(Exception):
    """Something the user can act on, said in one message (no traceback)."""


@dataclass(frozen=True)
class ServedModel:
    id: str
    type: str  # "lm", "multimodal", "embedding"
    status: str  # "running", "loading", ...

    @property
    def chats(self) -> bool:
        return self.type != "embedding"


def default_url() -> str:
    return os.environ.get("ORCHARD_URL", DEFAULT_URL)


def api_key_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def unreachable_message(url: str, exc: httpx.HTTPError) -> str:
    return (f"no Orchard server answers at {url} ({type(exc).__name__}: {exc}). Start one with `orchard serve` "
            "(in another terminal), or pass --url.")


def server_health(url: str, api_key: str | None = None, timeout_s: float = 5.0) -> dict:
    """The body of GET /health (200 ok/degraded or 503 unhealthy both carry it); ServerError if nothing answers."""
    try:
        response = httpx.get(f"{url}/health", headers=api_key_headers(api_key), timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise ServerError(unreachable_message(url, exc)) from exc
    if response.status_code not in (200, 503):
        raise ServerError(f"{url}/health answered HTTP {response.status_code}: is this an Orchard server?")
    try:
        return response.json()
    except ValueError as exc:
        raise ServerError(f"{url}/health answered something that is not JSON: is this an Orchard server?") from exc


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
