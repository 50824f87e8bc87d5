"""/v1/batches: OpenAI's Batches API (deployments/batches/runner.py runs them through these same routes): create,
retrieve, cancel, list; OpenAI's Batch object to the letter."""

from __future__ import annotations

import logging
from typing import Any

import httpx
from fastapi import APIRouter, FastAPI, Query
from pydantic import BaseModel, ConfigDict, Field

from deployments.api.openapi_errors import ANY_ROUTE, error_responses
from deployments.batches.files import list_page
from deployments.batches.runner import BatchRunner, Send
from deployments.ingress.edge import PRIORITY_HEADER
from engine.errors import InvalidRequestError

logger = logging.getLogger("ray.serve.orchard")
BATCHES_ROUTE = "/v1/batches"


class BatchCreate(BaseModel):
    """POST /v1/batches; fields a newer client adds are accepted and logged (output_expires_after: files are kept)."""

    model_config = ConfigDict(extra="allow")

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = Field(None, max_length=16)


def batches_router(runner: BatchRunner) -> APIRouter:
    router = APIRouter()

    @router.post(BATCHES_ROUTE, responses=error_responses((400, 401, 404, *ANY_ROUTE)))
    async def create(body: BatchCreate) -> dict[str, Any]:
        runner.resume()
        if body.model_extra:
            logger.info("POST /v1/batches: ignored fields %s", sorted(body.model_extra))
        if body.metadata and any(len(k) > 64 or len(v) > 512 for k, v in body.metadata.items()):
            raise InvalidRequestError("metadata keys hold at most 64 characters, values 512", param="metadata")
        return runner.create(body.input_file_id, body.endpoint, body.completion_window, body.metadata).to_wire()

    @router.get(BATCHES_ROUTE, responses=error_responses((400, 401, *ANY_ROUTE)))
    async def list_batches(limit: int = Query(20, ge=1, le=100), after: str | None = None) -> dict[str, Any]:
        runner.resume()
        return list_page(runner.batches.all(), after, limit, "batch")

    @router.get(BATCHES_ROUTE + "/{batch_id}", responses=error_responses((401, 404, *ANY_ROUTE)))
    async def retrieve(batch_id: str) -> dict[str, Any]:
        runner.resume()
        return runner.batches.get(batch_id).to_wire()

    @router.post(BATCHES_ROUTE + "/{batch_id}/cancel", responses=error_responses((400, 401, 404, *ANY_ROUTE)))
    async def cancel(batch_id: str) -> dict[str, Any]:
        runner.resume()
        return runner.cancel(batch_id).to_wire()

    return router


def internal_sender(app: FastAPI, headers: dict[str, str]) -> tuple[Send, httpx.AsyncClient]:
    """A batch line's request through this app's own routes (in process, no socket): the answer a client sending it
    alone gets, at the engine's batch priority (interactive requests first). `headers` carry the ingress's own
    inference key where keys are set; the client is the caller's to close."""
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://orchard-batch",
                               headers={**headers, PRIORITY_HEADER: "batch"}, timeout=None)

    async def send(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        response = await client.post(url, json=body)
        try:
            return response.status_code, response.json()
        except ValueError:
            return response.status_code, {"error": {"message": response.text[:500], "type": "server_error"}}

    return send, client


__all__ = ["BATCHES_ROUTE", "batches_router", "internal_sender"]
