"""The one place errors become HTTP: status, OpenAI error body, headers.

The errors of the HTTP edge itself (keys, body size) are defined here: the engine knows nothing of HTTP.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.errors import (
    ContextLengthExceededError,
    EngineDeadError,
    EngineRestartingError,
    InsufficientMemoryError,
    InvalidRequestError,
    ModelExistsError,
    ModelLoadError,
    ModelLoadingError,
    ModelNotFoundError,
    NoModelsLoadedError,
    McpServerError,
    ModelUnloadedError,
    OrchardError,
    QueueFullError,
    TooManyLoadsError,
    QueueTimeoutError,
    RetryLaterError,
)
from deployments.hub.errors import (
    CachedModelInUseError,
    CachedModelNotFoundError,
    DiskFullError,
    DownloadCancelledError,
    DownloadFailedError,
    DownloadInProgressError,
    DownloadNotFoundError,
    GatedRepoError,
    RepoNotFoundError,
)
from deployments.rag_calls import (
    DocumentNotFoundError, DocumentTooComplexError, DocumentTooLargeError, RagUnavailableError,
)

QUEUE_RETRY_AFTER_S = 1
LOAD_RETRY_AFTER_S = 5  # a load settles in seconds to minutes
ANTHROPIC_PATHS = "/v1/messages"  # these routes answer errors in Anthropic's shape


class AuthenticationError(OrchardError):
    """No API key, or one that is not configured (401). The message never quotes the key."""

    code = "invalid_api_key"


class PermissionDeniedError(OrchardError):
    """A valid key that may not use this route: an inference key on an admin route (403)."""

    code = "insufficient_permissions"


class RequestTooLargeError(OrchardError):
    """The request body is larger than the ingress's max_body_bytes (413)."""

    code = "request_too_large"


class ResponseNotFoundError(OrchardError):
    """GET / DELETE /v1/responses/{id} for an id the ingress does not hold: never stored, expired or deleted (404)."""

    code = "response_not_found"


class StoredFileNotFoundError(OrchardError):
    """/v1/files/{id} for an id the ingress does not hold: never uploaded or deleted (404)."""

    code = "file_not_found"


class BatchNotFoundError(OrchardError):
    """/v1/batches/{id} for an id the ingress does not hold (404)."""

    code = "batch_not_found"


class PreviousResponseNotFoundError(InvalidRequestError):
    """A `previous_response_id` (or an earlier response of its chain) the ingress does not hold (400, as OpenAI)."""

    code = "previous_response_not_found"


@dataclass
class WireError:
    status: int
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class _Rule:
    status: int
    type: str
    retry_after_s: int | None = None


# Most specific first: subclasses before their bases.
_RULES: list[tuple[type[OrchardError], _Rule]] = [
    (ContextLengthExceededError, _Rule(400, "invalid_request_error")),
    # A PDF over its reader's deadline or memory cap is too large too: to read, rather than to send.
    (DocumentTooComplexError, _Rule(413, "invalid_request_error")),
    (DocumentTooLargeError, _Rule(413, "invalid_request_error")),
    (InvalidRequestError, _Rule(400, "invalid_request_error")),
    (AuthenticationError, _Rule(401, "invalid_request_error")),
    (PermissionDeniedError, _Rule(403, "invalid_request_error")),
    (RequestTooLargeError, _Rule(413, "invalid_request_error")),
    (ModelNotFoundError, _Rule(404, "invalid_request_error")),
    (ResponseNotFoundError, _Rule(404, "invalid_request_error")),
    (StoredFileNotFoundError, _Rule(404, "invalid_request_error")),
    (BatchNotFoundError, _Rule(404, "invalid_request_error")),
    (DocumentNotFoundError, _Rule(404, "invalid_request_error")),
    (ModelExistsError, _Rule(409, "invalid_request_error")),
    (QueueFullError, _Rule(429, "rate_limit_error", QUEUE_RETRY_AFTER_S)),
    (TooManyLoadsError, _Rule(429, "rate_limit_error", LOAD_RETRY_AFTER_S)),
    (QueueTimeoutError, _Rule(503, "server_error", QUEUE_RETRY_AFTER_S)),
    (ModelLoadingError, _Rule(503, "server_error")),
    (ModelLoadError, _Rule(503, "server_error")),
    (NoModelsLoadedError, _Rule(503, "server_error")),
    (EngineRestartingError, _Rule(503, "server_error")),
    (ModelUnloadedError, _Rule(503, "server_error")),
    (EngineDeadError, _Rule(503, "server_error")),
    (RagUnavailableError, _Rule(503, "server_error")),
    # Hugging Face downloads: a gated repo is 403, not 401 (our 401 means the caller's own API key).
    (RepoNotFoundError, _Rule(404, "invalid_request_error")),
    (CachedModelNotFoundError, _Rule(404, "invalid_request_error")),
    (DownloadNotFoundError, _Rule(404, "invalid_request_error")),
    (GatedRepoError, _Rule(403, "invalid_request_error")),
    (DownloadInProgressError, _Rule(409, "invalid_request_error")),
    (CachedModelInUseError, _Rule(409, "invalid_request_error")),
    (DownloadCancelledError, _Rule(409, "invalid_request_error")),
    (DiskFullError, _Rule(507, "server_error")),
    (InsufficientMemoryError, _Rule(507, "server_error")),
    (DownloadFailedError, _Rule(502, "server_error")),
    (McpServerError, _Rule(424, "server_error")),
]


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def wire_error(exc: BaseException) -> WireError:
    """Any exception -> its HTTP status and OpenAI-shaped body (internal details stay in the logs)."""
    if not isinstance(exc, OrchardError):
        return WireError(500, error_body("Internal server error", "server_error", code="internal_error"))
    rule = next((r for cls, r in _RULES if isinstance(exc, cls)), _Rule(500, "server_error"))
    # A plain InvalidRequestError's code would repeat its type; OpenAI sends null there (and for a response id
    # it does not know).
    code = None if type(exc) in (InvalidRequestError, ResponseNotFoundError) else exc.code
    headers = {}
    retry_after = exc.retry_after_s if isinstance(exc, RetryLaterError) else rule.retry_after_s
    if retry_after is not None:
        headers["Retry-After"] = str(retry_after)
    if rule.status == 401:
        headers["WWW-Authenticate"] = "Bearer"  # RFC 9110: a 401 names the scheme to use
    return WireError(rule.status, error_body(exc.message, rule.type, exc.param, code), headers)


def http_error(status: int, message: str) -> WireError:
    """Starlette's own errors (unknown route, wrong method) in OpenAI's shape."""
    type_ = "invalid_request_error" if status < 500 else "server_error"
    code = {404: "not_found", 405: "method_not_allowed"}.get(status)
    return WireError(status, error_body(message, type_, code=code))


def validation_error(errors: list[dict[str, Any]]) -> WireError:
    """Pydantic's request validation errors: 400 (as OpenAI), naming the first offending field."""
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    messages = "; ".join(_describe(e) for e in errors[:5])
    return WireError(400, error_body(f"Invalid request: {messages}", "invalid_request_error", param))


def _describe(error: dict[str, Any]) -> str:
    loc = ".".join(str(p) for p in error.get("loc", ()) if p != "body")
    return f"{loc}: {error.get('msg', 'invalid')}" if loc else str(error.get("msg", "invalid"))


# ---- Anthropic's shape: same statuses, {"type": "error", "error": {"type", "message"}} ------------
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 409: "invalid_request_error", 413: "request_too_large",
                    429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    type_ = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": type_, "message": message}}


def as_anthropic(error: WireError) -> WireError:
    """An error mapped by the rules above, in Anthropic's body (the Messages routes answer so)."""
    message = error.body["error"]["message"]
    param = error.body["error"].get("param")
    if param and error.status == 400 and param not in message:
        message = f"{param}: {message}"  # Anthropic's bodies have no 'param': name it in the message
    return WireError(error.status, anthropic_error_body(error.status, message), error.headers)


def wire_error_for_path(path: str, error: WireError) -> WireError:
    """The error in the shape of the API that `path` belongs to."""
    return as_anthropic(error) if path.startswith(ANTHROPIC_PATHS) else error
