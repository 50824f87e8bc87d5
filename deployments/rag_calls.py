"""What crosses between the ingress and the RAG deployment (a Ray handle or an in-process call): plain dataclasses,
no numpy or FAISS, so the ingress imports them without the `embeddings` extra. Errors travel as values: RAG's
typed errors are declared here too (OrchardErrors, mapped to HTTP by api/errors.py with the rest).
A contract module: the ingress's side (ingress/, api/, transport/) and the RAG deployment (rag/) import it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator, Literal, Protocol

from deployments.model_calls import GenerateJob, StreamChunk
from engine.errors import InvalidRequestError, OrchardError


@dataclass(frozen=True)
class DocumentInfo:
    file_id: str  # sha256 of the uploaded bytes
    filename: str
    num_pages: int
    num_chunks: int
    created_at: float  # unix seconds


@dataclass(frozen=True)
class SearchHit:
    """One retrieved chunk: a query's source."""

    file_id: str
    filename: str
    page: int
    chunk: int
    text: str
    score: float  # cosine similarity


@dataclass
class UploadJob:
    filename: str
    data: bytes
    log_id: str = ""


@dataclass
class UploadOutcome:
    document: DocumentInfo | None = None
    status: Literal["indexed", "already_indexed"] = "indexed"
    error: OrchardError | None = None


@dataclass
class RetrievalJob:
    file_ids: list[str]
    query: str
    top_k: int
    log_id: str = ""


@dataclass
class RetrievalResult:
    sources: list[SearchHit] = field(default_factory=list)
    error: OrchardError | None = None


@dataclass
class AnswerJob:
    """Retrieve, then answer with `model`: `generate` carries the sampling and ids; its prompt is replaced by the
    one built over the sources."""

    retrieval: RetrievalJob
    model: str
    generate: GenerateJob


@dataclass
class DeleteOutcome:
    document: DocumentInfo | None = None
    error: OrchardError | None = None


@dataclass
class DocumentList:
    documents: list[DocumentInfo] = field(default_factory=list)
    error: OrchardError | None = None


class RagClient(Protocol):
    """How the ingress reaches the RAG deployment (a Serve handle, or a RagService in process)."""

    async def upload(self, job: UploadJob) -> UploadOutcome: ...

    async def retrieve(self, job: RetrievalJob) -> RetrievalResult: ...

    def answer(self, job: AnswerJob) -> AsyncIterator[RetrievalResult | StreamChunk]: ...

    async def list_documents(self) -> DocumentList: ...

    async def delete(self, file_id: str) -> DeleteOutcome: ...


# RAG's typed errors (413 too large or too complex to read, 400 unreadable, 404 unknown file_id, 503 unavailable).
class DocumentTooLargeError(InvalidRequestError):
    """A RAG upload over the byte, page or text limit (413)."""

    code = "document_too_large"


class DocumentTooComplexError(DocumentTooLargeError):
    """A RAG upload (a PDF) whose reading passed its deadline or memory cap: a bomb, or too much for the box (413)."""

    code = "document_too_complex"


class UnreadableDocumentError(InvalidRequestError):
    """A RAG upload that yields no text to index; the subclasses say why (400)."""

    code = "unreadable_document"


class EmptyDocumentError(UnreadableDocumentError):
    code = "empty_document"


class MalformedDocumentError(UnreadableDocumentError):
    code = "malformed_document"


class EncryptedDocumentError(UnreadableDocumentError):
    code = "encrypted_document"


class ImageOnlyDocumentError(UnreadableDocumentError):
    """A PDF whose pages hold no extractable text (scanned images): we do no OCR."""

    code = "image_only_document"


class UnsupportedDocumentTypeError(UnreadableDocumentError):
    code = "unsupported_document_type"


class RagUnavailableError(OrchardError):
    """RAG cannot serve: its embedding model is not running, or the `embeddings` extra is not installed (503)."""

    code = "rag_unavailable"


class DocumentNotFoundError(OrchardError):
    """A RAG file_id the store does not hold (404)."""

    code = "document_not_found"
