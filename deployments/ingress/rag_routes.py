"""/v1/rag/*: Bodega's RAG routes, answered by the RAG deployment (deployments/rag/deployment.py) over its client.

Uploads are multipart (the document in the field `file`). A query answers with the chosen chat model through the
same path as /v1/chat/completions (routes' generation.answer), with the sources added; `retrieval_only` returns
the sources alone.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
import uuid
from pathlib import PurePath
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from deployments.api.openai_convert import chat_job
from deployments.api.openai_render import ResponseMeta
from deployments.api.openapi_errors import (
    EVENT_STREAM, GENERATION, RAG_DOCUMENT, RAG_DOCUMENTS, RAG_UPLOAD, error_responses,
)
from deployments.api.rag_schemas import RagChatRenderer, RagQueryRequest, document_out, sources_out
from deployments.ingress.edge import REQUEST_ID
from deployments.ingress.generation import KEEPALIVE_S, answer
from deployments.ingress.multipart import form_upload
from deployments.ingress.model_registry import Registry
from deployments.metrics.ingress_metrics import Api, IngressMetrics
from deployments.model_calls import GenerateJob, StreamChunk
from deployments.rag_calls import (
    AnswerJob, DocumentNotFoundError, RagClient, RetrievalJob, RetrievalResult, UploadJob,
)
from engine.errors import InvalidRequestError

logger = logging.getLogger("ray.serve.orchard")
UPLOAD_ROUTE = "/v1/rag/upload"
# Room the multipart framing takes around the file, on top of rag.max_upload_bytes, in the body limit.
MULTIPART_OVERHEAD_BYTES = 64 * 1024
_FILE_ID = re.compile(r"^[0-9a-f]{64}$")
# The route reads its form itself (its own limits and errors); the spec still says what to send.
_UPLOAD_BODY = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["file"],
    "properties": {"file": {"type": "string", "format": "binary", "description": "a .pdf, .txt or .md file"}},
}}}}}


class RagAnswerClient:
    """The chunk source of a RAG answer: the RAG deployment's stream, whose first item (the retrieval) gives the
    renderer its sources."""

    def __init__(self, rag: RagClient, retrieval: RetrievalJob, model: str, renderer: RagChatRenderer) -> None:
        self._rag = rag
        self._retrieval = retrieval
        self._model = model
        self._renderer = renderer

    async def generate(self, job: GenerateJob) -> AsyncIterator[StreamChunk]:
        items = self._rag.answer(AnswerJob(self._retrieval, self._model, job))
        async with contextlib.aclosing(items):
            async for item in items:
                if isinstance(item, RetrievalResult):
                    if item.error is not None:
                        yield StreamChunk(error=item.error)
                        return
                    self._renderer.sources = item.sources
                    continue
                yield item


def rag_router(
    rag: RagClient, registry: Registry, metrics: IngressMetrics, keepalive_s: float = KEEPALIVE_S
) -> APIRouter:
    router = APIRouter()

    @router.post(UPLOAD_ROUTE, responses=error_responses(RAG_UPLOAD), openapi_extra=_UPLOAD_BODY)
    async def upload(request: Request) -> dict[str, Any]:
        filename, data = await _uploaded_file(request)
        outcome = await rag.upload(UploadJob(filename, data, REQUEST_ID.get()))
        if outcome.error is not None:
            raise outcome.error
        return document_out(outcome.document, outcome.status)

    @router.post("/v1/rag/query", responses={**EVENT_STREAM, **error_responses(GENERATION)})
    async def query(body: RagQueryRequest) -> Response:
        retrieval = body.retrieval(REQUEST_ID.get())
        if body.retrieval_only:
            result = await rag.retrieve(retrieval)
            if result.error is not None:
                raise result.error
            return JSONResponse({"object": "rag.retrieval", "query": body.query, "sources": sources_out(result.sources)})
        chat = body.chat_request()
        meta = ResponseMeta(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), chat.model)
        job = chat_job(chat, meta.id, REQUEST_ID.get())
        include_usage = chat.stream and chat.stream_options is not None and chat.stream_options.include_usage
        renderer = RagChatRenderer(meta, include_usage)
        await registry.route(chat.model)  # the model's own 404 / 503 before any retrieval
        logger.info("RAG query %s over %d documents for model %s, stream=%s [X-Request-Id %s]",
                    meta.id, len(retrieval.file_ids), chat.model, chat.stream, job.log_id)
        tally = metrics.request(Api.RAG, chat.model)
        return await answer(RagAnswerClient(rag, retrieval, chat.model, renderer), job, renderer, keepalive_s, tally)

    @router.get("/v1/rag/documents", responses=error_responses(RAG_DOCUMENTS))
    async def list_documents() -> dict[str, Any]:
        listed = await rag.list_documents()
        if listed.error is not None:
            raise listed.error
        return {"object": "list", "data": [document_out(d) for d in listed.documents]}

    @router.delete("/v1/rag/documents/{file_id}", responses=error_responses(RAG_DOCUMENT))
    async def delete_document(file_id: str) -> dict[str, Any]:
        if not _FILE_ID.match(file_id):  # ids are sha256 hex: anything else names no document (nor a path)
            raise DocumentNotFoundError(f"no document with file_id {file_id[:80]!r}", param="file_id")
        outcome = await rag.delete(file_id)
        if outcome.error is not None:
            raise outcome.error
        return {"id": file_id, "object": "rag.document", "deleted": True}

    return router


async def _uploaded_file(request: Request) -> tuple[str, bytes]:
    """The multipart field `file`: its bare file name (no directories) and bytes."""
    _, name, data = await form_upload(request, "the document")
    return PurePath(name.replace("\\", "/")).name or "upload", data