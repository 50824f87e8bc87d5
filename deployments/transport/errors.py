"""One mapping from a model call's transport failure to our typed errors, for the Ray handle and the channel."""

from __future__ import annotations

from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from engine.errors import EngineDeadError, ModelNotFoundError, OrchardError, QueueFullError


def model_process_died(model_id: str) -> EngineDeadError:
    """The error of a stream whose model replica went away, over the channel or a Ray handle alike."""
    return EngineDeadError(f"The process of model '{model_id}' died")


def model_call_failure(model_id: str, exc: BaseException) -> OrchardError:
    """Ray's errors on a model call (refused, gone, replica died or raised), as our typed errors."""
    if isinstance(exc, BackPressureError):
        return QueueFullError(f"The model '{model_id}' has too many queued requests")
    if isinstance(exc, DeploymentUnavailableError):
        return ModelNotFoundError(f"The model '{model_id}' is not available", param="model")
    if isinstance(exc, RayActorError):
        return model_process_died(model_id)
    return EngineDeadError(f"The model '{model_id}' failed: {type(exc).__name__}")
