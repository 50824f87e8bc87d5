"""Models a request may load by naming a repo in the local Hugging Face cache (the ingress's `auto_load_repos`
patterns, issue 55): loaded as the operator's on_demand models are, with default settings. The repo must be
complete in the cache (a request never downloads), and its kind is read from its files."""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path

from deployments.config import ModelConfig
from deployments.model_sources import cached_hub_source
from engine.errors import OrchardError


def repo_allowed(model_id: str, patterns: list[str]) -> bool:
    """Whether the operator's patterns allow a request to load the repo `model_id` names (read nothing yet)."""
    return "/" in model_id and any(fnmatch.fnmatchcase(model_id, pattern) for pattern in patterns)


def cached_repo_config(model_id: str, patterns: list[str]) -> ModelConfig | None:
    """The on_demand config of the cached repo `model_id` names, if the operator's patterns allow it; None: not
    allowed, not a repo id, not (completely) in the cache, or of a kind that does not load by default."""
    if not repo_allowed(model_id, patterns):
        return None
    try:
        config = ModelConfig(model_id=model_id, model_path=model_id)
        folder = cached_hub_source(config)
    except (OrchardError, ValueError):  # not a repo id ModelConfig or the hub accepts
        return None
    model_type = repo_model_type(folder) if folder is not None and folder.is_dir() else None
    return None if model_type is None else config.model_copy(update={"model_type": model_type})


def repo_model_type(folder: Path) -> str | None:
    """A sentence-transformers repo embeds; a config.json with a vision tower is multimodal; Whisper's is not
    loaded by default (None); another one is a language model. None: no config.json."""
    if (folder / "modules.json").is_file():
        return "embedding"
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or config.get("model_type") == "whisper":
        return None
    return "multimodal" if "vision_config" in config else "lm"


__all__ = ["cached_repo_config", "repo_allowed", "repo_model_type"]
