"""The ingress's fields in serve_config.yaml (its application's `args`): API keys, limits, media, RAG; validated
with pydantic, unknown fields refused by name. A model's fields are config.py's."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from deployments.config import DEFAULT_EMBEDDING_MODEL_ID, ModelConfig
from deployments.replica_options import RayActorOptions
from deployments.mcp_config import McpConfig

DEFAULT_MAX_FILE_BYTES = 200 * 1024 * 1024  # POST /v1/files: OpenAI's limit for a batch's input file
# Keys from the environment where a config field is unset (the config wins: see IngressConfig).
API_KEYS_ENV = "ORCHARD_API_KEYS"  # comma-separated
ADMIN_KEY_ENV = "ORCHARD_ADMIN_KEY"
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
_API_KEY = re.compile(r"[\x21-\x7e]{1,512}")  # printable ASCII, no spaces or commas (checked below)


@dataclass(frozen=True)
class MediaLimits:
    """What the ingress accepts of images in requests (IngressConfig's fields of the same names;
    ingress/media_fetch.py applies them)."""

    allow_remote_media: bool = False
    max_images_per_request: int = 16
    max_image_bytes: int = 20 * 1024 * 1024  # one image's encoded file, decoded from base64 or fetched
    remote_media_timeout_s: float = 10.0  # one fetch, redirects included
    remote_media_max_redirects: int = 3
    remote_media_allow_private: bool = False  # non-public hosts too, but never cloud metadata ones (media_hosts.py)


class RagConfig(BaseModel):
    """The ingress's `rag` arg: the RAG deployment (/v1/rag/*) beside the ingress. null turns the routes off."""

    model_config = ConfigDict(extra="forbid")

    embedding_model: str = Field(DEFAULT_EMBEDDING_MODEL_ID, description="a model of model_type embedding")
    storage_dir: str | None = Field(None, description="indexes and metadata (null: $ORCHARD_HOME/rag)")
    max_upload_bytes: int = Field(50 * 1024 * 1024, ge=1, description="larger uploads get 413")
    max_pages: int = Field(2_000, ge=1, description="PDFs with more pages get 413")
    max_text_chars: int = Field(16_000_000, ge=1, description="documents with more text get 413 (chunking and "
                                "embedding cost follow it)")
    # A PDF is read in a child process: past either limit it is killed and the upload gets 413 document_too_complex.
    read_seconds: float = Field(60.0, gt=0, description="the longest one PDF may take to read")
    read_memory_bytes: int = Field(1 << 30, ge=64 * 1024 * 1024, description="the memory one PDF's reader may take")
    parallel_reads: int = Field(2, ge=1, description="documents read at once; more uploads wait their turn")
    chunk_tokens: int = Field(200, ge=1, description="tokens per chunk, by the embedder's tokenizer")
    overlap_tokens: int = Field(40, ge=0, description="tokens a chunk repeats of the one before")
    max_top_k: int = Field(50, ge=1, description="the most sources a query may ask for (top_k)")


class AdminLoadLimits(BaseModel):
    """serve_config.yaml's `admin_loads`: bounds on what POST /v1/admin/load-model may ask for."""

    model_config = ConfigDict(extra="forbid")

    max_replicas: int | None = Field(
        None, ge=1, description="num_replicas a load may ask for (null: one per GPU of the cluster, at least 1)")
    max_cpus_per_replica: float | None = Field(
        None, ge=0, description="ray_actor_options.num_cpus a load may ask for (null: the largest node's CPUs)")
    max_gpus_per_replica: float | None = Field(
        None, ge=0, description="ray_actor_options.num_gpus a load may ask for (null: the largest node's GPUs)")
    allow_custom_resources: bool = Field(
        False, description="whether a load may name custom Ray resources (ray_actor_options.resources)")
    max_in_flight: int = Field(
        4, ge=1, description="loads running at once (downloading or starting); more get 429 until one settles")
    timeout_s: float = Field(
        900.0, gt=0, description="a load whose model does not serve this long after its files are here fails "
        "(its application is deleted); the download before it is not counted")


class MemoryBudget(BaseModel):
    """serve_config.yaml's `memory`: one memory budget across the node's models (ingress/residency.py)."""

    model_config = ConfigDict(extra="forbid")

    budget_bytes: int | None = Field(
        None, ge=1, description="the models' memory on this node together: a load that would pass it unloads the "
        "least recently used idle models that are not pinned first, or is refused (507) (null: no budget)")


class IngressConfig(BaseModel):
    """The ingress application's `args` in serve_config.yaml.

    Keys: a field set here wins; an unset one (null) is read from the environment of the Ray cluster
    (ORCHARD_API_KEYS, comma-separated; ORCHARD_ADMIN_KEY). Keys are SecretStr: never in a repr or a log.
    """

    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)  # a bad key is never echoed

    state_dir: str | None = Field(
        None, description="where the API-loaded model list and the Files API's uploads (files/) are kept")
    max_file_bytes: int = Field(
        DEFAULT_MAX_FILE_BYTES, ge=1, description="the largest file POST /v1/files accepts (a batch's JSONL input)")
    model_roots: list[str] | None = Field(
        None,
        description="admin loads of local folders must lie under one of these "
        "(null: Orchard's and Hugging Face's model caches, default_model_roots())",
    )
    restore_models: bool = Field(True, description="load the API-loaded model list again at start")
    enable_admin: bool = Field(True, description="serve the /v1/admin/* routes")
    api_keys: list[SecretStr] | None = Field(None, description="keys for the inference routes (null: from the env)")
    admin_key: SecretStr | None = Field(None, description="the key for /v1/admin/* (null: from the env)")
    max_body_bytes: int = Field(DEFAULT_MAX_BODY_BYTES, ge=1, description="larger request bodies get 413")
    status_poll_interval_s: float = Field(2.0, gt=0, description="seconds between reads of the models' Serve status")
    max_ongoing_requests: int = Field(1024, ge=1, description="requests the ingress replica takes at once")
    # Responses kept for GET /v1/responses/{id} and previous_response_id, in the ingress's memory.
    responses_store_size: int = Field(1000, ge=0, description="stored responses, least recently used out first")
    responses_store_bytes: int = Field(256 << 20, ge=0, description="their bytes (JSON and the items' objects), least recently used out first")
    responses_store_ttl_s: float = Field(86400.0, gt=0, description="a stored response unused this long is dropped")
    ray_actor_options: RayActorOptions = Field(
        default_factory=RayActorOptions, description="Ray's resources for the ingress replica (and the RAG one)")
    rag: RagConfig | None = Field(default_factory=RagConfig, description="/v1/rag/* (null: off)")
    mcp: McpConfig = Field(default_factory=McpConfig, description="the MCP servers the tool loop may use, its bounds")
    admin_loads: AdminLoadLimits = Field(
        default_factory=AdminLoadLimits, description="what POST /v1/admin/load-model may reserve, and its deadline")
    memory: MemoryBudget = Field(default_factory=MemoryBudget, description="the models' memory budget on the node")
    on_demand: list[ModelConfig] = Field(
        default_factory=list, description="models (each a model's args, as in the first table) loaded by the first "
        "request that names them (it waits, a stream with keep-alives), unloaded again under the memory budget; a "
        "pinned one loads at start")
    auto_load_repos: list[str] = Field(
        default_factory=list, description="repo-id patterns (fnmatch: 'mlx-community/*'; '*': any) of models in "
        "the local Hugging Face cache that a request naming one loads as an on_demand model, with default settings "
        "(nothing is downloaded for a request); empty: only on_demand models load so")
    # Images in requests: data URLs and base64 always; http(s) URLs only when allowed, from public addresses only
    # unless remote_media_allow_private (ingress/media_hosts.py). file:// and other schemes never.
    allow_remote_media: bool = Field(MediaLimits.allow_remote_media, description="fetch http(s) image URLs")
    max_images_per_request: int = Field(MediaLimits.max_images_per_request, ge=0, description="more images get 400")
    max_image_bytes: int = Field(MediaLimits.max_image_bytes, ge=1, description="one image's encoded size")
    remote_media_timeout_s: float = Field(MediaLimits.remote_media_timeout_s, gt=0, description="per image fetch")
    remote_media_max_redirects: int = Field(
        MediaLimits.remote_media_max_redirects, ge=0, description="redirects one image fetch may follow")
    remote_media_allow_private: bool = Field(
        MediaLimits.remote_media_allow_private,
        description="fetch images from loopback, private and other non-public addresses too (a trusted network); "
        "169.254.0.0/16 and other cloud metadata addresses never")

    @field_validator("api_keys")
    @classmethod
    def _valid_api_keys(cls, keys: list[SecretStr] | None) -> list[SecretStr] | None:
        for key in keys or []:
            check_api_key(key.get_secret_value(), "api_keys")
        return keys

    @field_validator("admin_key")
    @classmethod
    def _valid_admin_key(cls, key: SecretStr | None) -> SecretStr | None:
        if key is not None:
            check_api_key(key.get_secret_value(), "admin_key")
        return key

    def resolved_api_keys(self) -> list[str]:
        if self.api_keys is not None:
            return [key.get_secret_value() for key in self.api_keys]
        keys = [k.strip() for k in os.environ.get(API_KEYS_ENV, "").split(",") if k.strip()]
        for key in keys:
            check_api_key(key, API_KEYS_ENV)
        return keys

    def resolved_admin_key(self) -> str | None:
        if self.admin_key is not None:
            return self.admin_key.get_secret_value()
        key = os.environ.get(ADMIN_KEY_ENV, "").strip() or None
        if key is not None:
            check_api_key(key, ADMIN_KEY_ENV)
        return key

    def resolved_state_dir(self) -> Path:
        if self.state_dir:
            return Path(self.state_dir).expanduser()
        home = os.environ.get("ORCHARD_HOME")
        if home:
            return Path(home).expanduser() / "state"
        return Path.home() / ".cache" / "orchard" / "state"

    def media_limits(self) -> MediaLimits:
        return MediaLimits(self.allow_remote_media, self.max_images_per_request, self.max_image_bytes,
                           self.remote_media_timeout_s, self.remote_media_max_redirects,
                           self.remote_media_allow_private)

    def deployment_options(self) -> dict[str, Any]:
        # One ingress replica: the registry (load/unload bookkeeping) lives in it.
        return {
            "num_replicas": 1,
            "max_ongoing_requests": self.max_ongoing_requests,
            "ray_actor_options": self.ray_actor_options.to_ray(),
        }

    def rag_deployment_options(self) -> dict[str, Any]:
        # One RAG replica too: it owns the document store (the indexes in its memory, the folder on disk).
        return self.deployment_options()


def check_api_key(key: str, source: str) -> None:
    """A key a client can send in a header: printable ASCII without spaces or commas. Never quotes the key."""
    if not _API_KEY.fullmatch(key) or "," in key:
        raise ValueError(f"{source}: a key must be 1-512 printable ASCII characters without spaces or commas")
