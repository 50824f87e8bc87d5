"""RAG's typed errors: subclasses of the engine's OrchardError, so deployments/api/errors.py maps them to HTTP with
the rest (413 too large, 400 unreadable, 404 unknown file_id, 503 unavailable)."""

from __future__ import annotations

from engine.errors import InvalidRequestError, OrchardError


class DocumentTooLargeError(InvalidRequestError):
    """A RAG upload over the byte or page limit (413)."""

    code = "document_too_large"


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
