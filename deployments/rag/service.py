"""RagService: documents, retrieval and answers over an embedding model and a chat model, both reached through
their ModelClients (Serve handles in the graph, in-process services in tests). No Ray or HTTP here."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from pathlib import Path
from typing import AsyncIterator, Awaitable, Callable

import numpy as np

from deployments.ingress_config import RagConfig
from deployments.model_calls import ChatPrompt, EmbedJob, ModelClient, StreamChunk, TextTokensJob
from deployments.rag_calls import (
    AnswerJob, DeleteOutcome, DocumentList, RagUnavailableError, RetrievalJob, RetrievalResult, UploadJob,
    UploadOutcome,
)
from engine.errors import ModelNotFoundError, OrchardError

from .chunking import ChunkParams
from .extract import ExtractLimits
from .pipeline import RagPipeline, build_prompt
from .store import DocumentStore

logger = logging.getLogger("ray.serve.orchard")
ModelResolver = Callable[[str], Awaitable[ModelClient]]


class ModelEmbedder:
    """The pipeline's Embedder over an embedding model's client."""

    def __init__(self, resolve: ModelResolver, model_id: str) -> None:
        self._resolve = resolve
        self.model_id = model_id

    async def _client(self) -> ModelClient:
        try:
            return await self._resolve(self.model_id)
        except ModelNotFoundError as exc:
            raise RagUnavailableError(
                f"RAG's embedding model '{self.model_id}' is not loaded (the ingress's rag.embedding_model)"
            ) from exc

    async def embed(self, texts: list[str]) -> np.ndarray:
        # Chunks fit the model by construction; a question longer than the model reads is cut, not refused.
        result = await (await self._client()).embed(EmbedJob(texts, truncate=True))
        if result.error is not None:
            raise result.error
        return np.stack([np.frombuffer(vector, dtype="<f4") for vector in result.vectors]).astype(np.float32)

    async def count_tokens(self, texts: list[str]) -> list[int]:
        result = await (await self._client()).count_text_tokens(TextTokensJob(texts))
        if result.error is not None:
            raise result.error
        return result.counts


class RagService:
    def __init__(self, config: RagConfig, resolve: ModelResolver) -> None:
        self._resolve = resolve
        root = Path(config.storage_dir).expanduser() if config.storage_dir else None
        self.store = DocumentStore(root)
        for entry in self.store.broken:
            logger.warning("RAG document folder %s not served: %s", entry.path, entry.reason)
        self.pipeline = RagPipeline(
            ModelEmbedder(resolve, config.embedding_model), self.store,
            limits=ExtractLimits(
                max_bytes=config.max_upload_bytes, max_pages=config.max_pages, max_text_chars=config.max_text_chars,
                read_seconds=config.read_seconds, read_memory_bytes=config.read_memory_bytes,
                parallel_reads=config.parallel_reads,
            ),
            chunk_params=ChunkParams(config.chunk_tokens, config.overlap_tokens), max_top_k=config.max_top_k,
        )
        logger.info("RAG serving %d documents from %s", len(self.store.list_documents()), self.store.root)

    async def upload(self, job: UploadJob) -> UploadOutcome:
        try:
            result = await self.pipeline.upload(job.filename, job.data)
        except OrchardError as exc:
            logger.info("RAG upload of %r refused: %s [X-Request-Id %s]", job.filename, exc.message, job.log_id)
            return UploadOutcome(error=exc)
        logger.info("RAG upload %s (%r): %s, %d chunks [X-Request-Id %s]", result.document.file_id[:12],
                    job.filename, result.status, result.document.num_chunks, job.log_id)
        return UploadOutcome(result.document, result.status)

    async def retrieve(self, job: RetrievalJob) -> RetrievalResult:
        try:
            return RetrievalResult(await self.pipeline.query(job.file_ids, job.query, job.top_k))
        except OrchardError as exc:
            return RetrievalResult(error=exc)

    async def answer(self, job: AnswerJob) -> AsyncIterator[RetrievalResult | StreamChunk]:
        """The retrieval's result first, then the chat model's chunks for the prompt built over its sources."""
        retrieved = await self.retrieve(job.retrieval)
        yield retrieved
        if retrieved.error is not None:
            return
        messages = [dataclasses.asdict(m) for m in build_prompt(job.retrieval.query, retrieved.sources)]
        prompt = job.generate.prompt
        if not isinstance(prompt, ChatPrompt):
            raise TypeError("a RAG answer is a chat prompt")
        generate = dataclasses.replace(job.generate, prompt=dataclasses.replace(prompt, messages=messages))
        try:
            client = await self._resolve(job.model)
        except OrchardError as exc:
            yield StreamChunk(error=exc)
            return
        async with contextlib.aclosing(client.generate(generate)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def list_documents(self) -> DocumentList:
        return DocumentList(self.store.list_documents())

    async def delete(self, file_id: str) -> DeleteOutcome:
        try:
            return DeleteOutcome(await self.pipeline.delete(file_id))
        except OrchardError as exc:
            return DeleteOutcome(error=exc)
