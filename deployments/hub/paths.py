"""Where Hugging Face models live here and what may name one: the hub cache by huggingface_hub's rules, repo ids
checked before anything touches the disk or the network, and the files an MLX model needs."""

from __future__ import annotations

import os
import re
from pathlib import Path

from engine.errors import InvalidRequestError

# What an MLX model folder needs: weights and their index, config and generation config, tokenizer (json,
# sentencepiece .model, tiktoken, merges/vocab .txt), chat templates (.jinja) and processor configs (json).
# Never *.py: code from a model folder runs only when trusted, so it is not even downloaded.
MLX_ALLOW_PATTERNS = ["*.safetensors", "*.json", "*.jinja", "*.model", "*.tiktoken", "*.txt"]


def hub_cache_dir() -> Path:
    """Hugging Face's hub cache by huggingface_hub's rules, read now: its `constants` are fixed at its import."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(os.path.expandvars(explicit)).expanduser()
    hf_home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(os.path.expandvars(hf_home)).expanduser() / "hub"


def hub_endpoint() -> str:
    """HF_ENDPOINT (a mirror) read now, else the Hub."""
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def check_repo_id(raw: str, param: str = "model_path") -> str:
    """A Hugging Face model repo id `owner/name` (no '..', no absolute path, Hub's character rules), or a 400."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    message = (f"'{param}' must be an absolute path to a model folder or a Hugging Face repo id (owner/name)"
               if param == "model_path" else f"'{param}' must be a Hugging Face repo id (owner/name)")
    if raw.count("/") != 1 or raw.startswith(("/", "~")) or ".." in raw:
        raise InvalidRequestError(message, param=param)
    try:
        validate_repo_id(raw)
    except HFValidationError as exc:
        raise InvalidRequestError(message, param=param) from exc
    return raw


_REVISION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,254}")


def check_revision(raw: str | None) -> str:
    """A branch, tag or commit (`main`, `v1.0`, `refs/pr/1`, a hash), or a 400. huggingface_hub writes
    `refs/<revision>` in the cache without checking it, so no '..' and no leading '/' may reach it."""
    if raw is None:
        return "main"
    if not _REVISION.fullmatch(raw) or ".." in raw or "//" in raw or raw.endswith("/"):
        raise InvalidRequestError("'revision' must be a branch, tag or commit hash (letters, digits, '.', '_', '-', "
                                  "'/'; no '..')", param="revision")
    return raw
