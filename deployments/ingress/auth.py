"""API keys: which routes need which key, checked in constant time before a request's body is read.

Inference keys guard every route but /health, /ready, /metrics and the API docs; the admin key, if set, alone opens
/v1/admin/*, /v1/models/local/* and DELETE /v1/models/* (an inference key there gets 403). With no admin key the admin routes need what the inference
routes need. RAG's and the Files API's writes to the disk (upload, delete) need an inference key, or with none configured the admin key
when one is set: an operator who keys only the admin API keeps anonymous callers from filling its disk.
Keys arrive as `Authorization: Bearer <key>` (OpenAI) or `x-api-key: <key>` (Anthropic); neither the configured
keys nor a presented one is ever logged or repeated in an error.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from collections.abc import Callable
from enum import Enum
from typing import Any

from deployments.api.errors import AuthenticationError, PermissionDeniedError
from deployments.ingress_config import IngressConfig
from deployments.ingress.edge import send_error

# Load balancers probe /health and /ready and Prometheus scrapes /metrics without keys (as vLLM's); the API
# description holds nothing secret.
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
ADMIN_PATH = "/v1/admin"
LOCAL_MODELS_PATH = "/v1/models/local/"  # DELETE of a cached repo writes to the disk: the admin key's too
MODELS_PATH = "/v1/models/"  # and so does DELETE under it (Bodega's alias of the route above)
MISSING_KEY = "Missing API key: send it as 'Authorization: Bearer <key>' or 'x-api-key: <key>'"
INVALID_KEY = "Invalid API key"
ADMIN_ONLY = "This route needs the admin key; an inference key may not use it"


class RouteAccess(Enum):
    OPEN = "open"
    INFERENCE = "inference"
    DISK_WRITE = "disk_write"  # an inference route that keeps what it is sent on the server's disk (RAG)
    ADMIN = "admin"


RAG_PATH = "/v1/rag/"
RAG_READS = frozenset({"/v1/rag/query", "/v1/rag/documents"})
FILES_PATH = "/v1/files"  # the Files API: an upload or delete changes what the server keeps on its disk
BATCHES_PATH = "/v1/batches"  # and a batch writes its output and error files there


def route_access(path: str, method: str = "GET") -> RouteAccess:
    if path in OPEN_PATHS:
        return RouteAccess.OPEN
    if path == ADMIN_PATH or path.startswith((ADMIN_PATH + "/", LOCAL_MODELS_PATH)):
        return RouteAccess.ADMIN
    if method.upper() == "DELETE" and path.startswith(MODELS_PATH):  # Bodega's DELETE /v1/models/{id}: the cache's
        return RouteAccess.ADMIN
    if path.startswith(RAG_PATH) and path not in RAG_READS:  # upload, document delete (and unknown RAG paths)
        return RouteAccess.DISK_WRITE
    if any(path == p or path.startswith(p + "/") for p in (FILES_PATH, BATCHES_PATH)) and method.upper() in (
            "POST", "DELETE"):
        return RouteAccess.DISK_WRITE
    return RouteAccess.INFERENCE  # unknown paths too: no route map for callers without a key


def _digest(key: bytes) -> bytes:
    # Equal-length digests: compare_digest then leaks neither a key's contents nor its length.
    return hashlib.sha256(key).digest()


class ApiKeys:
    """The configured keys, as digests; repr shows only how many there are."""

    def __init__(self, inference: list[str], admin: str | None = None) -> None:
        if admin is not None and admin in inference:
            raise ValueError("the admin key must differ from every inference key (leave it unset to share them)")
        self._inference = tuple(_digest(k.encode()) for k in inference)
        self._admin = _digest(admin.encode()) if admin is not None else None

    @classmethod
    def from_config(cls, config: IngressConfig) -> ApiKeys:
        return cls(config.resolved_api_keys(), config.resolved_admin_key())

    @property
    def enabled(self) -> bool:
        return bool(self._inference) or self._admin is not None

    @property
    def has_admin_key(self) -> bool:
        return self._admin is not None

    def __repr__(self) -> str:
        return f"ApiKeys({len(self._inference)} inference key(s), admin key {'set' if self._admin else 'unset'})"

    def authorize(self, access: RouteAccess, presented: list[bytes]) -> None:
        """Returns if the presented keys open a route of this kind; raises the 401 or 403 error otherwise."""
        allowed = self._allowed(access)
        if allowed is None:
            return
        if not presented:
            raise AuthenticationError(MISSING_KEY)
        digests = [_digest(p) for p in presented]
        if any(_matches_any(d, allowed) for d in digests):
            return
        admin_only = access is RouteAccess.ADMIN and self._admin is not None
        if admin_only and any(_matches_any(d, self._inference) for d in digests):
            raise PermissionDeniedError(ADMIN_ONLY)  # a valid key, but this route is the admin key's alone
        raise AuthenticationError(INVALID_KEY)

    def _allowed(self, access: RouteAccess) -> tuple[bytes, ...] | None:
        """The key digests that open a route of this kind; None: the route is open."""
        if access is RouteAccess.OPEN:
            return None
        if access is RouteAccess.ADMIN and self._admin is not None:
            return (self._admin,)
        if not self._inference:
            return (self._admin,) if access is RouteAccess.DISK_WRITE and self._admin is not None else None
        return self._inference + ((self._admin,) if self._admin is not None else ())


def _matches_any(digest: bytes, allowed: tuple[bytes, ...]) -> bool:
    """Compares with every key, never stopping at a match: the time taken says nothing about which matched."""
    matched = False
    for key in allowed:
        matched |= hmac.compare_digest(digest, key)
    return matched


def presented_keys(headers: list[tuple[bytes, bytes]]) -> list[bytes]:
    """The keys a request carries: Bearer tokens of `Authorization` and `x-api-key` values."""
    keys = []
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                keys.append(token.strip())
        elif name == b"x-api-key" and value.strip():
            keys.append(value.strip())
    return keys


class ApiKeyMiddleware:
    """Refuses a request without the key its route needs before the body is read (401/403 in the API's shape)."""

    def __init__(self, app: Any, keys: ApiKeys) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] not in ("http", "websocket") or not self.keys.enabled:
            await self.app(scope, receive, send)
            return
        try:
            self.keys.authorize(route_access(scope["path"], scope.get("method", "GET")),
                                presented_keys(scope["headers"]))
        except (AuthenticationError, PermissionDeniedError) as exc:
            if scope["type"] == "websocket":  # refused before the handshake completes: the client sees HTTP 403
                await receive()
                await send({"type": "websocket.close", "code": 1008, "reason": exc.message[:120]})
            else:
                await send_error(scope, receive, send, exc)
            return
        await self.app(scope, receive, send)


# ---- the bind rule ------------------------------------------------------------------------
LOOPBACK_NAMES = frozenset({"localhost", "ip6-localhost"})


def is_loopback_host(host: str | None) -> bool:
    """Whether an HTTP bind address is reachable from this machine only (None: Serve's HTTP is disabled)."""
    if host is None:
        return True
    name = host.strip().strip("[]").lower()
    if name in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False  # a host name may resolve to any interface


def check_admin_exposure(enable_admin: bool, keys: ApiKeys, bind_host: str | None) -> None:
    """Beyond loopback, anyone who reaches the port could load models: the admin API then needs its own key."""
    if enable_admin and not keys.has_admin_key and not is_loopback_host(bind_host):
        raise ValueError(
            f"Refusing to start: HTTP binds to {bind_host!r} (beyond loopback) and the admin API is enabled "
            "without an admin key. Set the ingress's `admin_key` or ORCHARD_ADMIN_KEY, set `enable_admin: false`, "
            "or bind http_options.host to 127.0.0.1."
        )
