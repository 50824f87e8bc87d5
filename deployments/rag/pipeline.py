"""Upload -> extract, chunk, embed, store; query -> embed the question, search; and the chat prompt over the sources."""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np

from deployments.rag_calls import DocumentInfo, DocumentNotFoundError, SearchHit
from engine.errors import InvalidRequestError

from .chunking import Chunk, ChunkParams, chunk_pages, distinct_words
from .extract import ExtractLimits, Page, check_filename, extract_pages
from .store import DocumentStore

Source = SearchHit  # what a query returns: file_id, filename, page, chunk, text, score

SYSTEM_PROMPT = (
    "Answer the question using only the numbered sources below. Cite the sources you use as [1], [2], ... "
    "If the sources do not contain the answer, say that you don't know."
)


class Embedder(Protocol):
    async def embed(self, texts: list[str]) -> np.ndarray:
        """One unit-normalised float32 row per text."""
        ...

    async def count_tokens(self, texts: list[str]) -> list[int]:
        """Tokens of each text without special tokens (the chunker's measure)."""
        ...


@dataclass(frozen=True)
class UploadResult:
    document: DocumentInfo
    status: Literal["indexed", "already_indexed"]


@dataclass(frozen=True)
class ChatMessage:
    role: Literal["system", "user"]
    content: str


@dataclass
class _HashLock:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0  # uploads holding or waiting for it


class RagPipeline:
    def __init__(
        self,
        embedder: Embedder,
        store: DocumentStore,
        *,
        limits: ExtractLimits | None = None,
        chunk_params: ChunkParams | None = None,
        embed_batch_size: int = 64,
        max_top_k: int = 50,
    ) -> None:
        self.embedder = embedder
        self.store = store
        self.limits = limits or ExtractLimits()
        self.chunk_params = chunk_params or ChunkParams()
        self.embed_batch_size = embed_batch_size
        self.max_top_k = max_top_k
        # The same bytes under the same name at once (a double submit, a retry storm) share one run and its outcome:
        # a bomb is read once, not once per copy, each after the last one's deadline.
        self._flights: dict[tuple[str, str], asyncio.Task[UploadResult]] = {}
        # One upload per content hash at a time (other names of the same bytes): the second finds the first's result.
        self._upload_locks: dict[str, _HashLock] = {}
        # Documents read at once (a PDF's reader may take read_memory_bytes): see _read_slots.
        self._reads: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None

    async def upload(self, filename: str, data: bytes) -> UploadResult:
        """Extracts, chunks, embeds and stores the file; the same bytes again return the stored document."""
        check_filename(filename)
        key = (hashlib.sha256(data).hexdigest(), filename)
        flight = self._flights.get(key)
        if flight is not None:
            result = await asyncio.shield(flight)
            return UploadResult(result.document, "already_indexed")
        flight = self._flights[key] = asyncio.ensure_future(self._upload_one(key[0], filename, data))
        flight.add_done_callback(lambda done: self._landed(key, done))
        # Shielded: a caller that goes away leaves the run to the others waiting on it (bounded by the deadline).
        return await asyncio.shield(flight)

    def _landed(self, key: tuple[str, str], flight: asyncio.Task[UploadResult]) -> None:
        if self._flights.get(key) is flight:
            del self._flights[key]
        if not flight.cancelled():
            flight.exception()  # retrieved: with every caller gone, asyncio would log it as never retrieved

    async def _upload_one(self, file_id: str, filename: str, data: bytes) -> UploadResult:
        held = self._upload_locks.setdefault(file_id, _HashLock())
        held.users += 1
        try:
            async with held.lock:
                return await self._upload_locked(file_id, filename, data)
        finally:
            # Counted, not lock.locked(): a released lock reads free before the waiter it wakes has taken it.
            held.users -= 1
            if held.users == 0 and self._upload_locks.get(file_id) is held:
                del self._upload_locks[file_id]

    async def _upload_locked(self, file_id: str, filename: str, data: bytes) -> UploadResult:
        existing = self.store.get(file_id)
        if existing is not None:
            return UploadResult(existing, "already_indexed")
        async with self._read_slots():
            # A PDF is read in a child process, waited on in a thread: off the event loop.
            pages = await asyncio.to_thread(extract_pages, filename, data, self.limits)
        chunks = await self.chunk(pages)
        vectors = await self.embed_texts([chunk.text for chunk in chunks])
        info = DocumentInfo(file_id, filename, len(pages), len(chunks), time.time())
        stored, created = await asyncio.to_thread(self.store.add, info, chunks, vectors)
        return UploadResult(stored, "indexed" if created else "already_indexed")

    def _read_slots(self) -> asyncio.Semaphore:
        # A semaphore binds to the loop it first waits on; tests run one pipeline under several asyncio.run()s.
        loop = asyncio.get_running_loop()
        if self._reads is None or self._reads[0] is not loop:
            self._reads = (loop, asyncio.Semaphore(self.limits.parallel_reads))
        return self._reads[1]

    async def query(self, file_ids: list[str], query: str, top_k: int = 5) -> list[Source]:
        """Retrieval only: the top_k chunks of the given documents by cosine similarity, best first."""
        if not query.strip():
            raise InvalidRequestError("query must not be empty", param="query")
        if not 1 <= top_k <= self.max_top_k:
            raise InvalidRequestError(f"top_k must be in [1, {self.max_top_k}], got {top_k}", param="top_k")
        if not file_ids:
            raise InvalidRequestError("file_id must name at least one document", param="file_id")
        missing = [file_id for file_id in file_ids if self.store.get(file_id) is None]
        if missing:  # before spending an embedding on the question
            raise DocumentNotFoundError(f"no document with file_id {missing[0]!r}", param="file_id")
        vector = (await self.embedder.embed([query]))[0]
        return self.store.search(file_ids, vector, top_k)

    async def delete(self, file_id: str) -> DocumentInfo:
        return await asyncio.to_thread(self.store.delete, file_id)

    def list_documents(self) -> list[DocumentInfo]:
        return self.store.list_documents()

    async def chunk(self, pages: list[Page]) -> list[Chunk]:
        """The pages' chunks, measured by the embedder's tokenizer: each distinct word counted once, in one call."""
        words = distinct_words(pages)
        counts = dict(zip(words, await self.embedder.count_tokens(words), strict=True))
        return await asyncio.to_thread(chunk_pages, pages, counts.__getitem__, self.chunk_params)

    async def embed_texts(self, texts: list[str]) -> np.ndarray:
        """Embeds in batches of embed_batch_size: one float32 unit row per text."""
        batches = [texts[i : i + self.embed_batch_size] for i in range(0, len(texts), self.embed_batch_size)]
        return np.concatenate([await self.embedder.embed(batch) for batch in batches]).astype(np.float32)


def build_prompt(query: str, sources: list[Source]) -> list[ChatMessage]:
    """A system message with the rules and a user message holding the numbered sources, then the question."""
    blocks = [
        f"[{number}] {source.filename}, page {source.page}:\n{source.text}"
        for number, source in enumerate(sources, start=1)
    ]
    user = "Sources:\n\n" + "\n\n".join(blocks) + f"\n\nQuestion: {query}"
    return [ChatMessage("system", SYSTEM_PROMPT), ChatMessage("user", user)]
