"""Getting a model from the Hugging Face Hub or its local cache: the typed errors (subclasses of the engine's
OrchardError, so deployments/api/errors.py maps them to HTTP with the rest), and huggingface_hub's and the OS's errors
as those, with messages that say what to do."""

from __future__ import annotations

import errno
from pathlib import Path

from engine.errors import OrchardError


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


_DISK_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def typed_hub_error(exc: BaseException, repo_id: str, cache_dir: Path, endpoint: str) -> OrchardError:
    """huggingface_hub's and the OS's errors as Orchard's, with messages that say what to do."""
    import httpx2
    from huggingface_hub import errors as hf
    from huggingface_hub.utils import OfflineModeIsEnabled

    if isinstance(exc, OrchardError):
        return exc
    if isinstance(exc, hf.GatedRepoError):
        return GatedRepoError(f"'{repo_id}' is a gated repo: accept its terms on the Hub and set HF_TOKEN (or pass "
                              "a token) with access to it", param="repo_id")
    if isinstance(exc, hf.RevisionNotFoundError):
        return RevisionNotFoundError(f"'{repo_id}' has no such revision", param="revision")
    if isinstance(exc, hf.RepositoryNotFoundError):
        return RepoNotFoundError(f"no model repo '{repo_id}' on the Hub (or it is private and the token has no "
                                 "access)", param="repo_id")
    os_error = next((e for e in _chain(exc) if isinstance(e, OSError) and e.errno is not None), None)
    if os_error is not None and os_error.errno in _DISK_FULL_ERRNOS:
        return DiskFullError(f"no space left for '{repo_id}' in the Hugging Face cache {cache_dir} "
                             f"({os_error.strerror}): free disk space or set HF_HUB_CACHE elsewhere", param="repo_id")
    if isinstance(os_error, PermissionError):
        return DownloadFailedError(f"the Hugging Face cache {cache_dir} is not writable ({os_error.strerror})",
                                   param="repo_id")
    causes = _chain(exc)
    if any(isinstance(e, OfflineModeIsEnabled) for e in causes):
        return DownloadFailedError(f"'{repo_id}' is not (completely) in the local Hugging Face cache and HF_HUB_OFFLINE "
                                   "is set: unset it to download", param="repo_id")
    unreachable = next((e for e in causes if isinstance(e, (httpx2.ConnectError, httpx2.TimeoutException))), None)
    if unreachable is not None:
        return DownloadFailedError(f"cannot reach the Hugging Face Hub at {endpoint} to download '{repo_id}' "
                                   f"({type(unreachable).__name__}: {unreachable}): check the network or HF_ENDPOINT",
                                   param="repo_id")
    return DownloadFailedError(f"downloading '{repo_id}' failed: {type(exc).__name__}: {exc}", param="repo_id")


def _chain(exc: BaseException | None) -> list[BaseException]:
    seen: list[BaseException] = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return seen
