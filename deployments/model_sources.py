"""Where a model may come from: the folders and files a model config names, checked before anything loads.

serve_config.yaml is the operator's and may name any folder (check_model_sources); an admin load (and the restore
of the list it keeps) may name only a folder under model_roots or a Hugging Face repo id already cached, and never
an operator-only field (check_admin_model). A speculative draft model (speculative.draft_model_path) follows the
same rules, except that a repo id must already be in the local cache (it is never downloaded for a load).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deployments.config import ModelConfig
from engine.errors import InvalidRequestError
from engine.speech.piper_voice import piper_voice_file
from deployments.hub.paths import check_repo_id as _check_repo_id
from deployments.hub.paths import hub_cache_dir as hf_hub_cache


def check_model_folder(
    raw: str, roots: list[str] | None = None, param: str = "model_path", base_dir: Path | None = None
) -> Path:
    """A local model folder, safely: no '..', under `roots` if given, a directory holding config.json (or a Piper
    voice: <name>.onnx with its <name>.onnx.json, or an image model's component folders).

    Relative paths are allowed only with a base_dir (serve_config.yaml: the directory `serve run` ran in).
    """
    resolved = _allowed_folder_path(raw, roots, param, base_dir)
    if not resolved.is_dir():
        raise InvalidRequestError(f"'{param}' is not a directory: {raw}", param=param)
    if not (resolved / "config.json").is_file() and piper_voice_file(resolved) is None and not is_image_model(resolved):
        raise InvalidRequestError(f"'{param}' holds no config.json (nor a Piper voice: <name>.onnx with "
                                  f"<name>.onnx.json, nor an image model's transformer/): {raw}", param=param)
    return resolved


def is_image_model(folder: Path) -> bool:
    """A diffusion model in the Hugging Face layout (or mflux's): its components in folders, the transformer's first."""
    return (folder / "transformer").is_dir()


def _allowed_folder_path(raw: str, roots: list[str] | None, param: str, base_dir: Path | None = None) -> Path:
    """The resolved path if it may be used, before looking at what is there: a path outside the roots is refused
    the same way whether it exists or not, so a caller cannot probe the server's files."""
    path = Path(raw).expanduser()
    if ".." in path.parts:
        raise InvalidRequestError(f"'{param}' must not contain '..'", param=param)
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    if not path.is_absolute():
        raise InvalidRequestError(f"'{param}' must be an absolute path to a local model folder", param=param)
    resolved = path.resolve()
    if roots is not None and not any(resolved.is_relative_to(Path(r).expanduser().resolve()) for r in roots):
        raise InvalidRequestError(f"'{param}' lies outside the allowed model_roots", param=param)
    return resolved


def check_model_sources(config: ModelConfig, base_dir: Path | None = None) -> ModelConfig:
    """Validate every path a serve_config.yaml model names (the operator's: no roots); returns a copy with
    absolute paths."""
    updates: dict[str, Any] = {}
    if config.uses_embedded_model:
        pass
    elif is_repo_id(config.model_path) and not (base_dir is not None and (base_dir / config.model_path).is_dir()):
        updates["model_path"] = str(operator_hub_model(config))
    else:
        updates["model_path"] = str(check_model_folder(config.model_path, base_dir=base_dir))
    if config.chat_template_file is not None:
        template = Path(config.chat_template_file).expanduser()
        if not template.is_absolute() and base_dir is not None:
            template = base_dir / template
        if ".." in template.parts or not template.is_absolute() or not template.is_file():
            raise InvalidRequestError(
                "'chat_template_file' must be an absolute path to a file", param="chat_template_file"
            )
        updates["chat_template_file"] = str(template.resolve())
    draft = _draft_path(config)
    if draft is not None:
        updates["speculative"] = _with_draft_folder(config, _operator_draft(draft, base_dir, config.auto_download))
    updates.update(_adapter_folders(config, None, base_dir))
    return config.model_copy(update=updates)


def _adapter_folders(config: ModelConfig, roots: list[str] | None, base_dir: Path | None = None) -> dict[str, Any]:
    """lora_paths and adapters as absolute folders (under `roots` when given; relative to base_dir for the
    operator's file): the same rules as a model folder's."""
    updates: dict[str, Any] = {}
    if config.lora_paths:
        updates["lora_paths"] = [str(adapter_folder(p, roots, "lora_paths", base_dir)) for p in config.lora_paths]
    if config.adapters:
        updates["adapters"] = {name: str(adapter_folder(p, roots, f"adapters.{name}", base_dir))
                               for name, p in config.adapters.items()}
    return updates


def adapter_folder(raw: str, roots: list[str] | None, param: str, base_dir: Path | None = None) -> Path:
    """A LoRA adapter's folder, safely (no '..', under `roots` if given), holding an adapter_config.json."""
    resolved = _allowed_folder_path(raw, roots, param, base_dir)
    if not (resolved / "adapter_config.json").is_file():
        raise InvalidRequestError(f"'{param}' is not an adapter folder (no adapter_config.json): {raw}", param=param)
    return resolved


# ---- the draft model of speculative decoding: a local folder, or a repo id already in the hub cache ------
DRAFT_PARAM = "speculative.draft_model_path"


def _draft_path(config: ModelConfig) -> str | None:
    return config.speculative.draft_model_path if config.speculative is not None else None


def _with_draft_folder(config: ModelConfig, folder: Path) -> Any:
    assert config.speculative is not None
    return config.speculative.model_copy(update={"draft_model_path": str(folder)})


def _operator_draft(draft: str, base_dir: Path | None, auto_download: bool | None) -> Path:
    """serve_config.yaml's draft: any folder (relative to base_dir), or a repo id (downloaded first when it is not
    cached, unless auto_download is false, as the model's own)."""
    if is_repo_id(draft) and not (base_dir is not None and (base_dir / draft).is_dir()):
        _check_draft_repo_id(draft)
        if auto_download is not False and cached_snapshot(draft) is None:
            from deployments.hub.downloads import DownloadManager

            DownloadManager().download(draft)
        return _cached_draft(draft)
    return check_model_folder(draft, param=DRAFT_PARAM, base_dir=base_dir)


@dataclass(frozen=True)
class HubFetch:
    """A Hugging Face repo a load needs that the local cache lacks."""

    repo_id: str
    param: str  # the load's field that named it, for its errors
    revision: str | None = None
    files: list[str] | None = None  # None: what an MLX model needs


def uncached_repos(config: ModelConfig) -> list[HubFetch]:
    """The repos a load of `config` would download: its model's and its draft's, those not (completely) cached."""
    fetches = []
    if not config.uses_embedded_model and is_repo_id(config.model_path) and cached_hub_source(config) is None:
        fetches.append(HubFetch(config.model_path, "model_path", config.revision, hub_files(config)))
    draft = _draft_path(config)
    if draft is not None and is_repo_id(draft) and cached_snapshot(draft) is None:
        fetches.append(HubFetch(draft, DRAFT_PARAM))
    return fetches


def _cached_draft(repo_id: str) -> Path:
    """A draft repo's snapshot in the local hub cache (downloaded before this, if it is to be)."""
    _check_draft_repo_id(repo_id)
    snapshot = cached_snapshot(repo_id)
    if snapshot is None:
        raise InvalidRequestError(
            f"'{DRAFT_PARAM}' '{repo_id}' is not in the local Hugging Face cache (or not completely): download it "
            "first (POST /v1/admin/download-model, or `orchard pull`), or leave auto_download unset",
            param=DRAFT_PARAM,
        )
    return snapshot


def operator_hub_model(config: ModelConfig) -> Path:
    """serve_config.yaml's repo id: what it loads from in the cache, downloaded first unless auto_download is false."""
    source = cached_hub_source(config)
    if source is not None or config.auto_download is False:
        return source if source is not None else hub_source(config)
    from deployments.hub.downloads import DownloadManager

    download = DownloadManager().download(config.model_path, config.revision, files=hub_files(config))
    snapshot = Path(download.snapshot_path)
    return snapshot / config.gguf_file if config.gguf_file else snapshot


# ---- models loaded through the admin API (or restored from its list) -------------------------------------
# Fields only serve_config.yaml may set, and why: over HTTP they would run or read what the caller names.
OPERATOR_ONLY_FIELDS = {
    "trust_remote_code": "it lets a model folder run its own Python code",
    "chat_template_file": "it reads a file on the server",
}


def default_model_roots() -> list[str]:
    """Where admin loads may come from when model_roots is unset: Orchard's and Hugging Face's model caches."""
    # Imported here: it imports MLX, which the config's other users do not need.
    from engine.models.default_model import models_root

    return [str(models_root()), str(hf_hub_cache())]


def check_admin_policy(config: ModelConfig, roots: list[str]) -> None:
    """What an admin load may name, whatever is on disk: no operator-only field; a folder under `roots`, or a
    Hugging Face repo id."""
    for field, why in OPERATOR_ONLY_FIELDS.items():
        if getattr(config, field) not in (None, False):
            raise InvalidRequestError(
                f"'{field}' is an operator setting: set it in serve_config.yaml, not over HTTP ({why})", param=field
            )
    draft = _draft_path(config)
    if draft is not None and _is_local_path(draft):
        _allowed_folder_path(draft, roots, DRAFT_PARAM)
    elif draft is not None:
        _check_draft_repo_id(draft)
    for path in config.lora_paths or []:
        _allowed_folder_path(path, roots, "lora_paths")
    for name, path in config.adapters.items():
        _allowed_folder_path(path, roots, f"adapters.{name}")
    if config.uses_embedded_model:
        return
    if _is_local_path(config.model_path):
        _allowed_folder_path(config.model_path, roots, "model_path")
    else:
        _check_repo_id(config.model_path)


def _check_draft_repo_id(repo_id: str) -> None:
    try:
        _check_repo_id(repo_id, DRAFT_PARAM)
    except InvalidRequestError as exc:
        raise InvalidRequestError(
            f"'{DRAFT_PARAM}' must be an absolute path to a model folder or a Hugging Face repo id (owner/name)",
            param=DRAFT_PARAM,
        ) from exc


def check_admin_model(config: ModelConfig, roots: list[str]) -> ModelConfig:
    """check_admin_policy, then what is on disk: a copy whose model_path is the local folder to load (a repo id's
    snapshot in the local Hugging Face cache)."""
    check_admin_policy(config, roots)
    updates: dict[str, Any] = {}
    draft = _draft_path(config)
    if draft is not None:
        folder = check_model_folder(draft, roots, DRAFT_PARAM) if _is_local_path(draft) else _cached_draft(draft)
        updates["speculative"] = _with_draft_folder(config, folder)
    updates.update(_adapter_folders(config, roots))
    if config.uses_embedded_model:
        return config.model_copy(update=updates)
    if _is_local_path(config.model_path):
        updates["model_path"] = str(check_model_folder(config.model_path, roots))
    else:
        updates["model_path"] = str(hub_source(config))
    return config.model_copy(update=updates)


def check_operator_model(config: ModelConfig) -> ModelConfig:
    """An operator's own config (the ingress's on_demand models): a copy whose model_path is the local folder to
    load, with no model_roots rule (serve_config.yaml's models have none either); absolute paths only."""
    if config.uses_embedded_model:
        return config
    if _is_local_path(config.model_path):
        return config.model_copy(update={"model_path": str(check_model_folder(config.model_path))})
    return config.model_copy(update={"model_path": str(hub_source(config))})


def hub_source(config: ModelConfig) -> Path:
    """What a repo id's model loads from in the local hub cache: its snapshot folder (every file it needs present),
    or its `gguf_file`. Nothing is downloaded here."""
    source = cached_hub_source(config)
    if source is None:
        what = f"'{config.gguf_file}' of '{config.model_path}'" if config.gguf_file else f"'{config.model_path}'"
        raise InvalidRequestError(
            f"'model_path' {what} is not in the local Hugging Face cache (or not completely): download it first "
            "(POST /v1/admin/download-model, or `orchard pull`), or leave auto_download unset",
            param="model_path",
        )
    return source


def cached_hub_source(config: ModelConfig) -> Path | None:
    _check_repo_id(config.model_path)
    if config.gguf_file is None:
        return cached_snapshot(config.model_path, config.revision)
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(config.model_path, config.gguf_file, cache_dir=hf_hub_cache(),
                                   revision=config.revision)
    return Path(found) if isinstance(found, str) else None


def hub_files(config: ModelConfig) -> list[str] | None:
    """The files of the repo a load needs: its gguf_file alone, else (None) what an MLX model needs."""
    return [config.gguf_file] if config.gguf_file else None


def cached_snapshot(repo_id: str, revision: str | None = None) -> Path | None:
    """A repo's complete snapshot folder (of `revision`, else `main`) in the local hub cache, else None."""
    from deployments.hub.cache import find_cached_model

    _check_repo_id(repo_id)
    cached = find_cached_model(repo_id, hf_hub_cache(), revision)
    return Path(cached.snapshot_path) if cached is not None and cached.is_complete else None


def is_repo_id(raw: str) -> bool:
    """Whether model_path names a Hugging Face repo (owner/name) rather than a folder or an embedded model."""
    return raw.count("/") == 1 and not raw.startswith(("/", "~", "."))


def _is_local_path(raw: str) -> bool:
    return raw.startswith(("/", "~"))
