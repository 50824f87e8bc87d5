"""One typed error hierarchy for the engine; deployments/ maps it to wire error bodies (the model-download and RAG
errors are deployments/hub/errors.py's and deployments/rag/errors.py's, subclasses of OrchardError too)."""

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


class NoModelsLoadedError(OrchardError):
    """A request for a model while the server has none at all (Bodega's 503 "No model loaded")."""

    code = "no_models_loaded"


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


class ImagePixelsNeededError(OrchardError):
    """A prompt sent without its images' pixels (the serving side took them for kept by the engine) whose images'
    features the engine does not hold: the sender sends it again with them; never a client's answer.
    `never_kept`: this engine keeps none (the model cannot merge kept features without pixels, or no budget)."""

    code = "image_pixels_needed"

    def __init__(self, message: str, *, never_kept: bool = False) -> None:
        super().__init__(message)
        self.never_kept = never_kept


class InsufficientMemoryError(OrchardError):
    """A model that would not fit the memory left beside the models already running (507)."""

    code = "insufficient_memory"


class ModelExistsError(OrchardError):
    """A load asked for a model id that is already loaded (or loading)."""

    code = "model_already_loaded"


class TooManyLoadsError(OrchardError):
    """As many admin loads run as the operator allows (admin_loads.max_in_flight): retry once one settles."""

    code = "too_many_loads"


class McpServerError(OrchardError):
    """An MCP server a request uses could not be connected to or listed (424, as OpenAI answers), or is declared
    with a setting that cannot be used (an environment variable it names is not set)."""

    code = "mcp_server_error"
