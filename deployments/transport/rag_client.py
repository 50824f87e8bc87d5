"""ServeRagClient: the ingress's client of the RAG deployment, over its Serve handle (answers as a handle stream)."""

from __future__ import annotations

from typing import Any, AsyncIterator

from ray.exceptions import RayError
from ray.serve.exceptions import RayServeException

from deployments.model_calls import StreamChunk
from deployments.rag_calls import (
    AnswerJob, DeleteOutcome, DocumentList, RagUnavailableError, RetrievalJob, RetrievalResult, UploadJob,
    UploadOutcome,
)
from engine.errors import OrchardError


def rag_call_failure(exc: BaseException) -> OrchardError:
    return RagUnavailableError(f"The RAG deployment failed: {type(exc).__name__}")


class ServeRagClient:
    def __init__(self, handle: Any) -> None:
        self._handle = handle
        self._stream_handle = handle.options(stream=True)

    async def upload(self, job: UploadJob) -> UploadOutcome:
        try:
            return await self._handle.upload.remote(job)
        except (RayServeException, RayError) as exc:
            return UploadOutcome(error=rag_call_failure(exc))

    async def retrieve(self, job: RetrievalJob) -> RetrievalResult:
        try:
            return await self._handle.retrieve.remote(job)
        except (RayServeException, RayError) as exc:
            return RetrievalResult(error=rag_call_failure(exc))

    async def answer(self, job: AnswerJob) -> AsyncIterator[RetrievalResult | StreamChunk]:
        response = self._stream_handle.answer.remote(job)
        finished = False
        try:
            async for item in response:
                yield item
            finished = True
        except (RayServeException, RayError) as exc:
            finished = True
            yield StreamChunk(error=rag_call_failure(exc))
        finally:
            if not finished:  # the client went away: the RAG replica's generator, and so the model's request, end
                response.cancel()

    async def list_documents(self) -> DocumentList:
        try:
            return await self._handle.list_documents.remote()
        except (RayServeException, RayError) as exc:
            return DocumentList(error=rag_call_failure(exc))

    async def delete(self, file_id: str) -> DeleteOutcome:
        try:
            return await self._handle.delete.remote(file_id)
        except (RayServeException, RayError) as exc:
            return DeleteOutcome(error=rag_call_failure(exc))
