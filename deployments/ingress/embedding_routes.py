"""POST /v1/embeddings: OpenAI's embeddings route, answered by a model of model_type embedding."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter

from deployments.api.embeddings_schemas import EmbeddingRequest, embedding_response
from deployments.api.openapi_errors import GENERATION, error_responses
from deployments.ingress.edge import REQUEST_ID
from deployments.ingress.model_registry import Registry
from deployments.metrics.ingress_metrics import Api, IngressMetrics, RequestOutcome

logger = logging.getLogger("ray.serve.orchard")


def embeddings_router(registry: Registry, metrics: IngressMetrics) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/embeddings", responses=error_responses(GENERATION))
    async def embeddings(body: EmbeddingRequest) -> dict[str, Any]:
        client = await registry.route(body.model)
        tally = metrics.request(Api.EMBEDDINGS, body.model)
        try:
            result = await client.embed(body.job(REQUEST_ID.get()))
        except BaseException as exc:
            tally.end_by_exception(exc)
            raise
        if result.error is not None:
            tally.end(RequestOutcome.ERROR)
            raise result.error
        tally.end(RequestOutcome.FINISHED)
        logger.info("embeddings for model %s: %d inputs, %d tokens [X-Request-Id %s]",
                    body.model, len(result.vectors), result.prompt_tokens, REQUEST_ID.get())
        return embedding_response(body, result)

    return router
