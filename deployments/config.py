"""serve_config.yaml / admin load-model fields, validated with pydantic (unknown fields refused by name)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.models.names import DEFAULT_MODEL_ID
from deployments.bodega import from_bodega
from deployments.chat.parsers.selection import REASONING_PARSER_NAMES, TOOL_PARSER_NAMES

# `model_path: default` means the embedded SmolLM2 model, converted on first use by the model's replica.
DEFAULT_MODEL_PATH = "default"
# Bodega's parser names (chat/parsers/selection.py); unset ones are inferred from the chat template.
KNOWN_PARSERS = {"tool_call_parser": TOOL_PARSER_NAMES, "reasoning_parser": REASONING_PARSER_NAMES}
# The Serve deployment of every model application (the registry recognises model applications by it).
MODEL_SERVER_DEPLOYMENT = "ModelServer"
_MODEL_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@+/-]*$")
# Serve names each replica's log file "replica_<app>_ModelServer_<8 chars>.log" (and .log.N, _memray_N.bin) after
# the application, and a file name holds at most 255 bytes: a 256-character id failed with "File name too long".
# 128 characters (app name at most 191 with each '/' as '--', no empty parts) leave that room and fit HF repo ids.
MAX_MODEL_ID_CHARS = 128
# Serve's config builder writes a log file named after the application, so '/' cannot be in an
# application name (Ray 2.60); model "org/name" is application "org--name".
APP_NAME_SLASH = "--"


class RayActorOptions(BaseModel):
    """Ray's per-replica resources. CPUs are scheduling tokens only (MLX is not bound by them)."""

    model_config = ConfigDict(extra="forbid")

    num_cpus: float = Field(0.1, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    memory: int | None = Field(None, ge=0, description="bytes Ray reserves for the replica")
    resources: dict[str, float] = Field(default_factory=dict)

    def to_ray(self) -> dict[str, Any]:
        options: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.memory is not None:
            options["memory"] = self.memory
        if self.resources:
            options["resources"] = dict(self.resources)
        return options


class AdvancedOptions(BaseModel):
    """Internal knobs with measured defaults (docs/architecture.md says why each): change them to measure."""

    model_config = ConfigDict(extra="forbid")

    # Pad prefill forwards to a few shapes, warmed at load for up to prefill_warmup_seconds (null: on with a
    # GPU); the warm-up keeps a burst's first forwards from building kernels.
    pad_prefill_shapes: bool | None = None
    prefill_warmup_seconds: float = Field(EngineConfig.prefill_warmup_seconds, ge=0)
    # Stream chunks per second for all of this model's streams together (each stream's window grows with the
    # number of streams, 20-250 ms): every chunk costs CPU across replica, ingress and proxy.
    stream_chunks_per_s: float = Field(250.0, gt=0)
    # The model processes' GIL switch interval (null: Python's 5 ms): the engine thread waited up to 5 ms for
    # the GIL after each device wait behind Ray's threads.
    gil_switch_interval_ms: float | None = Field(0.5, gt=0)
    # An ingress on the replica's node streams over a Unix socket (transport/channel.py) instead of one Ray
    # handle stream per request (false: always the handle; several replicas use the handle anyway).
    stream_channel: bool = True
    # On unload, open streams get this long to finish before they end with model_unloaded.
    unload_drain_s: float = Field(10.0, ge=0)


class ModelConfig(BaseModel):
    """One model: a serve_config.yaml application's `args`, or the body of POST /v1/admin/load-model.

    Bodega's field names are accepted too (deployments/bodega.py); unknown fields are refused by name.
    """

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model_path: str = Field(min_length=1)
    model_id: str | None = None
    model_type: Literal["lm"] = "lm"
    context_length: int | None = Field(None, ge=2)
    # Run the weights in this dtype (null: as stored).
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    max_num_seqs: int = Field(EngineConfig.max_num_seqs, ge=1)
    max_prefill_seqs: int = Field(EngineConfig.max_prefill_seqs, ge=1)
    max_decode_seqs: int = Field(EngineConfig.max_decode_seqs, ge=1)
    prefill_chunk_tokens: int = Field(EngineConfig.prefill_chunk_tokens, ge=0)
    # null: what this machine prefills in ~0.5 s (measured at load; a GPU-sized constant stalls a CPU for minutes)
    prefill_step_tokens: int | None = Field(None, ge=0)
    enable_prefix_cache: bool = True
    prefix_cache_bytes: int | None = Field(None, ge=0)
    queue_size: int | None = Field(100, ge=0)
    queue_timeout: float | None = Field(300.0, gt=0)
    chat_template_file: str | None = None
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    trust_remote_code: bool = False
    # Ray Serve deployment options.
    num_replicas: int = Field(1, ge=1)
    max_ongoing_requests: int = Field(512, ge=1, description="Serve's default of 5 would throttle an LLM")
    ray_actor_options: RayActorOptions = Field(default_factory=RayActorOptions)
    advanced: AdvancedOptions = Field(default_factory=AdvancedOptions)

    @model_validator(mode="before")
    @classmethod
    def _bodega_names(cls, fields: Any) -> Any:
        return from_bodega(fields)

    @field_validator("tool_call_parser", "reasoning_parser")
    @classmethod
    def _known_parser(cls, value: str | None, info: Any) -> str | None:
        known = KNOWN_PARSERS[info.field_name]
        if value is not None and value not in known:
            raise ValueError(f"unknown parser '{value}' (choose from {', '.join(known)})")
        return value

    @field_validator("model_id")
    @classmethod
    def _given_model_id(cls, value: str | None) -> str | None:
        return value if value is None else check_model_id(value)

    @model_validator(mode="after")
    def _check(self) -> "ModelConfig":
        if self.model_id is None:
            self.model_id = check_model_id(default_model_id(self.model_path))
        try:
            self.engine_config()
        except InvalidRequestError as exc:  # surface engine limits at config time, not in the replica
            raise ValueError(exc.message) from exc
        return self

    @property
    def id(self) -> str:
        assert self.model_id is not None  # filled by the validator
        return self.model_id

    @property
    def uses_default_model(self) -> bool:
        return self.model_path == DEFAULT_MODEL_PATH

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            max_num_seqs=self.max_num_seqs,
            max_prefill_seqs=self.max_prefill_seqs,
            max_decode_seqs=self.max_decode_seqs,
            prefill_chunk_tokens=self.prefill_chunk_tokens,
            prefill_step_tokens=self.prefill_step_tokens,
            pad_prefill_shapes=self.advanced.pad_prefill_shapes,
            prefill_warmup_seconds=self.advanced.prefill_warmup_seconds,
            context_length=self.context_length,
            queue_size=self.queue_size,
            queue_timeout=self.queue_timeout,
            enable_prefix_cache=self.enable_prefix_cache,
            prefix_cache_bytes=self.prefix_cache_bytes,
            dtype=self.dtype,
        )

    def deployment_options(self) -> dict[str, Any]:
        return {
            "num_replicas": self.num_replicas,
            "max_ongoing_requests": self.max_ongoing_requests,
            "ray_actor_options": self.ray_actor_options.to_ray(),
            # A failed model load is reported, not retried 20 times (Serve's default).
            "max_constructor_retry_count": 1,
            # Serve kills a replica that has not stopped by then: the unload's drain and the engine's stop come first.
            "graceful_shutdown_timeout_s": self.advanced.unload_drain_s + 20.0,
        }


class IngressConfig(BaseModel):
    """The ingress application's `args` in serve_config.yaml."""

    model_config = ConfigDict(extra="forbid")

    state_dir: str | None = Field(None, description="where the API-loaded model list is kept")
    model_roots: list[str] | None = Field(
        None,
        description="admin loads of local folders must lie under one of these "
        "(null: Orchard's and Hugging Face's model caches, default_model_roots())",
    )
    restore_models: bool = True
    enable_admin: bool = True
    status_poll_interval_s: float = Field(2.0, gt=0)
    max_ongoing_requests: int = Field(1024, ge=1)
    ray_actor_options: RayActorOptions = Field(default_factory=RayActorOptions)

    def resolved_state_dir(self) -> Path:
        if self.state_dir:
            return Path(self.state_dir).expanduser()
        home = os.environ.get("ORCHARD_HOME")
        if home:
            return Path(home).expanduser() / "state"
        return Path.home() / ".cache" / "orchard" / "state"

    def deployment_options(self) -> dict[str, Any]:
        # One ingress replica: the registry (load/unload bookkeeping) lives in it.
        return {
            "num_replicas": 1,
            "max_ongoing_requests": self.max_ongoing_requests,
            "ray_actor_options": self.ray_actor_options.to_ray(),
        }


def check_model_id(model_id: str) -> str:
    """A model id that can name its Serve application (and that application's log files)."""
    if len(model_id) > MAX_MODEL_ID_CHARS:
        raise ValueError(
            f"model_id is {len(model_id)} characters long; the most is {MAX_MODEL_ID_CHARS} "
            "(Serve names log files after it)"
        )
    if not _MODEL_ID.match(model_id) or ".." in model_id.split("/"):
        raise ValueError(f"model_id '{model_id}' may hold only letters, digits and . _ : @ + / -")
    if "" in model_id.split("/"):
        raise ValueError(f"model_id '{model_id}' must not have an empty part between '/'")
    if APP_NAME_SLASH in model_id:
        raise ValueError(f"model_id '{model_id}' must not contain '{APP_NAME_SLASH}' (it stands for '/')")
    return model_id


def serve_app_name(model_id: str) -> str:
    """The Serve application that runs a model."""
    return model_id.replace("/", APP_NAME_SLASH)


def model_id_of_app(app_name: str) -> str:
    return app_name.replace(APP_NAME_SLASH, "/")


def default_model_id(model_path: str) -> str:
    """Bodega defaults the id to the path; a folder's name reads better and has no leading '/'."""
    if model_path == DEFAULT_MODEL_PATH:
        return DEFAULT_MODEL_ID
    return Path(model_path).name or model_path


def check_model_folder(
    raw: str, roots: list[str] | None = None, param: str = "model_path", base_dir: Path | None = None
) -> Path:
    """A local model folder, safely: no '..', under `roots` if given, a directory holding config.json.

    Relative paths are allowed only with a base_dir (serve_config.yaml: the directory `serve run` ran in).
    """
    resolved = _allowed_folder_path(raw, roots, param, base_dir)
    if not resolved.is_dir():
        raise InvalidRequestError(f"'{param}' is not a directory: {raw}", param=param)
    if not (resolved / "config.json").is_file():
        raise InvalidRequestError(f"'{param}' holds no config.json: {raw}", param=param)
    return resolved


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
    if not config.uses_default_model:
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
    return config.model_copy(update=updates)


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


def hf_hub_cache() -> Path:
    """Hugging Face's hub cache by huggingface_hub's rules, read now: its `constants` are fixed at its import."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(os.path.expandvars(explicit)).expanduser()
    hf_home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(os.path.expandvars(hf_home)).expanduser() / "hub"


def check_admin_policy(config: ModelConfig, roots: list[str]) -> None:
    """What an admin load may name, whatever is on disk: no operator-only field; a folder under `roots`, or a
    Hugging Face repo id."""
    for field, why in OPERATOR_ONLY_FIELDS.items():
        if getattr(config, field) not in (None, False):
            raise InvalidRequestError(
                f"'{field}' is an operator setting: set it in serve_config.yaml, not over HTTP ({why})", param=field
            )
    if config.uses_default_model:
        return
    if _is_local_path(config.model_path):
        _allowed_folder_path(config.model_path, roots, "model_path")
    else:
        _check_repo_id(config.model_path)


def check_admin_model(config: ModelConfig, roots: list[str]) -> ModelConfig:
    """check_admin_policy, then what is on disk: a copy whose model_path is the local folder to load (a repo id's
    snapshot in the local Hugging Face cache)."""
    check_admin_policy(config, roots)
    if config.uses_default_model:
        return config
    if _is_local_path(config.model_path):
        folder = check_model_folder(config.model_path, roots)
    else:
        folder = hub_snapshot_folder(config.model_path)
    return config.model_copy(update={"model_path": str(folder)})


def hub_snapshot_folder(repo_id: str) -> Path:
    """The folder of a Hugging Face repo's `main` revision in the local hub cache (nothing is downloaded)."""
    from huggingface_hub import try_to_load_from_cache

    _check_repo_id(repo_id)
    config_file = try_to_load_from_cache(repo_id, "config.json", cache_dir=hf_hub_cache())
    if not isinstance(config_file, str):  # None (not cached) or "cached as missing"
        raise InvalidRequestError(
            f"'model_path' '{repo_id}' is not in the local Hugging Face cache (downloading it is not supported yet; "
            "a model folder must be an absolute path)",
            param="model_path",
        )
    return Path(config_file).parent


def _is_local_path(raw: str) -> bool:
    return raw.startswith(("/", "~"))


def _check_repo_id(raw: str) -> None:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(raw)
    except HFValidationError as exc:
        raise InvalidRequestError(
            "'model_path' must be an absolute path to a model folder or a Hugging Face repo id (org/name)",
            param="model_path",
        ) from exc
