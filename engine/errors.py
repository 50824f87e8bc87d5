"""One typed error hierarchy for the engine; deployments/ maps it to wire error bodies."""

from __future__ import annotations


class OrchardError(Exception):
    """Base of every error the engine reports to a caller.

    `code` is a stable machine-readable name; the HTTP layer picks status codes
    and body shapes from the subclass, never from the message text.
    """

    code = "internal_error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequestError(OrchardError):
    """The request is malformed or a parameter is out of range (names the field)."""

    code = "invalid_request_error"


class ContextLengthExceededError(InvalidRequestError):
    code = "context_length_exceeded"


class KVBudgetExceededError(InvalidRequestError):
    """The request's KV (prompt + max_tokens) could never fit the model's KV budget, even running alone."""

    code = "kv_budget_exceeded"


class QueueFullError(OrchardError):
    """The engine holds as many requests as it may; retry later."""

    code = "queue_full"


class QueueTimeoutError(OrchardError):
    """The request waited longer than `queue_timeout` before it could start."""

    code = "queue_timeout"


class ModelNotFoundError(OrchardError):
    code = "model_not_found"


class ModelLoadError(OrchardError):
    code = "model_load_failed"


class EngineDeadError(OrchardError):
    """The engine thread stopped; no request can make progress."""

    code = "engine_dead"


class ModelUnloadedError(OrchardError):
    """The model was unloaded while the request ran (or before it could start)."""

    code = "model_unloaded"


LOADING_RETRY_AFTER_S = 5


class RetryLaterError(OrchardError):
    """The model will serve again shortly: the caller is told to retry after retry_after_s (Retry-After)."""

    # A default, so that the error unpickles (exceptions are rebuilt from their message, then get their fields).
    def __init__(self, message: str, *, retry_after_s: int = LOADING_RETRY_AFTER_S) -> None:
        super().__init__(message, param="model")
        self.retry_after_s = retry_after_s


class EngineRestartingError(RetryLaterError):
    """The model's engine died and is being restarted in place."""

    code = "engine_restarting"


class ModelLoadingError(RetryLaterError):
    """The model exists but is still loading."""

    code = "model_loading"


class ModelExistsError(OrchardError):
    """A load asked for a model id that is already loaded (or loading)."""

    code = "model_already_loaded"


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


class HubError(OrchardError):
    """Getting a model from the Hugging Face Hub (or its local cache) failed; the subclasses say why."""

    code = "hub_error"


class RepoNotFoundError(HubError):
    """The Hub has no such repo, or hides a private one from this token (404)."""

    code = "repo_not_found"


class RevisionNotFoundError(RepoNotFoundError):
    code = "revision_not_found"


class GatedRepoError(HubError):
    """A gated repo this server's token (HF_TOKEN or the one given) may not download (403: not the caller's key)."""

    code = "gated_repo"


class DownloadFailedError(HubError):
    """The transfer itself failed: network, Hub error, cache not writable (502)."""

    code = "download_failed"


class DiskFullError(DownloadFailedError):
    """The cache's disk is full or over quota (507)."""

    code = "insufficient_storage"


class DownloadCancelledError(HubError):
    code = "download_cancelled"


class DownloadInProgressError(HubError):
    """The repo is downloading: it cannot be deleted until the download ends or is cancelled (409)."""

    code = "download_in_progress"


class CachedModelNotFoundError(HubError):
    """The local Hugging Face cache holds no such repo (404)."""

    code = "cached_model_not_found"


class DownloadNotFoundError(HubError):
    """No download of this server has that id (never started, or finished long enough ago to be forgotten) (404)."""

    code = "download_not_found"


class CachedModelInUseError(HubError):
    """A cached repo a loaded model serves from: it cannot be deleted until the model is unloaded (409)."""

    code = "model_in_use"
