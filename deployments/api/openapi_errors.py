"""The error answers each route documents in the OpenAPI spec (FastAPI `responses=`), in each API's body shape."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from pydantic import BaseModel


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIErrorBody(BaseModel):
    error: OpenAIErrorDetail


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorBody(BaseModel):
    type: Literal["error"]
    error: AnthropicErrorDetail


_MEANING = {
    400: "Invalid request: a field is malformed or out of range (named in `param`), or the prompt exceeds the context",
    401: "Missing or invalid API key (when keys are configured)",
    403: "An inference key on an admin route (when an admin key is configured)",
    404: "Unknown model, route, stored response, RAG document, download, Hugging Face repo or cached repo",
    409: "The model is already loaded, or a load or unload of it is in progress (a cached repo: a model serves from "
         "it or it downloads)",
    413: "The request body is larger than the ingress's max_body_bytes (a RAG upload: rag.max_upload_bytes, pages, "
         "text, or its reader's time or memory)",
    424: "An MCP server the request uses (Anthropic's mcp_servers, a Responses mcp tool) could not be reached or "
         "listed",
    429: "The model's queue is full, or as many admin loads run as the server allows; retry after Retry-After seconds",
    500: "Internal server error",
    501: "A documented route this server does not serve yet (Bodega's image generation and edits)",
    502: "A Hugging Face download the request waited for failed (the Hub's or the network's error)",
    503: "No model is loaded, or the model is loading, failed, unhealthy or its queue wait timed out (or RAG's "
         "embedder is not running); retry later",
    507: "The disk holding the Hugging Face cache is full",
}

# Every route can answer these: the body limit and the last-resort handler apply everywhere.
ANY_ROUTE = (413, 500)
GENERATION = (400, 401, 404, 429, 503, *ANY_ROUTE)
TOOL_LOOP_GENERATION = (*GENERATION, 424)  # /v1/messages and /v1/responses: their MCP servers
COUNT_TOKENS = (400, 401, 404, 503, *ANY_ROUTE)
LISTING = (401, *ANY_ROUTE)
MODEL_LISTING = (400, 401, *ANY_ROUTE)  # GET /v1/models: its ?verify_with_hub= must be a boolean
MODEL_LOOKUP = (401, 404, *ANY_ROUTE)
STORED_RESPONSE = (401, 404, *ANY_ROUTE)
# A load waited for answers its download's errors too (a missing repo 404, a failed transfer 502, a full disk 507).
ADMIN_LOAD = (400, 401, 403, 404, 409, 429, 502, 503, 507, *ANY_ROUTE)
ADMIN_UNLOAD = (400, 401, 403, 404, 409, 503, *ANY_ROUTE)
ADMIN_LISTING = (401, 403, *ANY_ROUTE)
# Hugging Face downloads: a bad repo id or revision is 400; the transfer's own failures arrive later, as the
# download's state (SSE error event, GET /v1/admin/downloads).
DOWNLOAD_START = (400, 401, 403, *ANY_ROUTE)
DOWNLOAD_CANCEL = (401, 403, 404, *ANY_ROUTE)
CACHE_DELETE = (400, 401, 403, 404, 409, *ANY_ROUTE)
RAG_UPLOAD = (400, 401, 503, *ANY_ROUTE)
RAG_DOCUMENTS = (401, 503, *ANY_ROUTE)
RAG_DOCUMENT = (401, 404, 503, *ANY_ROUTE)
# /health answers 503 with its usual body (not an error body) while no model runs.
HEALTH_UNHEALTHY: dict[int | str, dict[str, Any]] = {
    503: {"description": "No model is running", "content": {"application/json": {"schema": {"type": "object"}}}}
}
# /ready answers 503 with its usual body (which models still load or failed) until every model runs.
NOT_READY: dict[int | str, dict[str, Any]] = {
    503: {"description": "Some model is not running yet (or failed)",
          "content": {"application/json": {"schema": {"type": "object"}}}}
}
# A streamed answer (`stream: true`) is Server-Sent Events; the schema describes one event (OpenAPI < 3.2).
_SSE_EVENT = {"type": "object", "required": ["data"],
              "properties": {"event": {"type": "string"}, "data": {"type": "string"}}}
EVENT_STREAM: dict[int | str, dict[str, Any]] = {200: {"content": {"text/event-stream": {"schema": _SSE_EVENT}}}}


def error_responses(statuses: tuple[int, ...], anthropic: bool = False) -> dict[int | str, dict[str, Any]]:
    model = AnthropicErrorBody if anthropic else OpenAIErrorBody
    return {status: {"model": model, "description": _MEANING[status]} for status in sorted(set(statuses))}


def document_errors_as_sent(app: FastAPI) -> None:
    """FastAPI documents a 422 for every route with a body; request validation answers 400 here (as OpenAI's and
    Anthropic's APIs do), so the spec drops it."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            for operations in schema.get("paths", {}).values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
            schemas = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
