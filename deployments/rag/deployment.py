"""RagServer: the Serve deployment of RAG, bound beside the ingress in its application (one replica: it owns the
document store). It reaches the embedding model and the answering chat model through their Serve handles."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator

from ray import serve
from ray.serve.exceptions import RayServeException

from deployments.config import serve_app_name
from deployments.ingress_config import RagConfig
from deployments.model_calls import StreamChunk
from deployments.rag_calls import (
    AnswerJob, DeleteOutcome, DocumentList, RagUnavailableError, RetrievalJob, RetrievalResult, UploadJob,
    UploadOutcome,
)
from deployments.ray_loopback import keep_replica_grpc_on_loopback
from deployments.transport.model_client import ServeModelClient
from engine.errors import EngineDeadError, ModelNotFoundError, OrchardError

logger = logging.getLogger("ray.serve.orchard")
RAG_SERVER_DEPLOYMENT = "RagServer"
# A model call failing with these may hold a handle of an application since deleted.
STALE_CLIENT_ERRORS = (ModelNotFoundError, EngineDeadError, RagUnavailableError)
EXTRA_HINT = "RAG needs the 'embeddings' extra (faiss-cpu, pypdf): pip install -e '.[embeddings]' (or bash scripts/install.sh)"


@serve.deployment(name=RAG_SERVER_DEPLOYMENT)
class RagServer:
    async def __init__(self, config: dict[str, Any]) -> None:
        keep_replica_grpc_on_loopback()
        self.config = RagConfig.model_validate(config)
        self._clients: dict[str, ServeModelClient] = {}
        self.service = None
        try:
            from deployments.rag.service import RagService  # faiss and pypdf: the optional extra
        except ImportError as exc:
            logger.warning("/v1/rag/* off: %s (%s)", EXTRA_HINT, exc)
            return
        self.service = await asyncio.to_thread(RagService, self.config, self._model_client)  # reads the indexes

    async def _model_client(self, model_id: str) -> ServeModelClient:
        client = self._clients.get(model_id)
        if client is None:
            try:
                handle = await asyncio.to_thread(serve.get_app_handle, serve_app_name(model_id))
            except RayServeException as exc:
                raise ModelNotFoundError(f"The model '{model_id}' does not exist", param="model") from exc
            client = self._clients[model_id] = ServeModelClient(model_id, handle)
        return client

    def _unavailable(self) -> OrchardError:
        return RagUnavailableError(EXTRA_HINT)

    async def upload(self, job: UploadJob) -> UploadOutcome:
        if self.service is None:
            return UploadOutcome(error=self._unavailable())
        return await self.service.upload(job)

    async def retrieve(self, job: RetrievalJob) -> RetrievalResult:
        if self.service is None:
            return RetrievalResult(error=self._unavailable())
        result = await self.service.retrieve(job)
        if result.error is not None and isinstance(result.error, STALE_CLIENT_ERRORS):
            self._clients.clear()
        return result

    async def answer(self, job: AnswerJob) -> AsyncIterator[RetrievalResult | StreamChunk]:
        if self.service is None:
            yield RetrievalResult(error=self._unavailable())
            return
        async for item in self.service.answer(job):
            if item.error is not None and isinstance(item.error, STALE_CLIENT_ERRORS):
                self._clients.clear()  # an application deleted (and maybe deployed again): new handles next time
            yield item

    async def list_documents(self) -> DocumentList:
        if self.service is None:
            return DocumentList(error=self._unavailable())
        return await self.service.list_documents()

    async def delete(self, file_id: str) -> DeleteOutcome:
        if self.service is None:
            return DeleteOutcome(error=self._unavailable())
        return await self.service.delete(file_id)
