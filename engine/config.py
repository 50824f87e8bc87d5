"""Engine configuration, declared once: each knob's type, default, bounds and one line on what it does.

The serving edge (deployments/config.py) builds serve_config.yaml's and the admin API's fields from these
declarations and validates a model's values by building an EngineConfig; Bodega's names for some knobs are mapped
by deployments/bodega.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from engine.errors import InvalidRequestError
from engine.kv.quantization import KV_BITS, KV_GROUP_SIZES, KVQuantization
from engine.spec_decode.config import SpeculativeConfig

MIN_PREFIX_CACHE_BYTES = 1 << 20
KNOB = "knob"  # the dataclass field metadata key of a knob's Knob


@dataclass(frozen=True)
class Knob:
    """What an EngineConfig field means (one line, shown in docs/configuration.md) and its numeric bounds
    (None: open on that side). A None value means "unset" and is within any bounds."""

    doc: str
    ge: float | None = None
    gt: float | None = None
    le: float | None = None

    def problem(self, name: str, value: Any) -> str | None:
        """Why `value` is out of bounds for the field `name` (None: it is within them)."""
        if value is None:
            return None
        if self.gt is not None and self.le is not None and not self.gt < value <= self.le:
            return f"'{name}' must be in ({self.gt}, {self.le}], got {value}"
        if self.ge is not None and value < self.ge:
            return f"'{name}' must be >= {self.ge}"
        if self.gt is not None and value <= self.gt:
            return f"'{name}' must be > {self.gt}"
        if self.le is not None and value > self.le:
            return f"'{name}' must be <= {self.le}"
        return None


def knob(default: Any, doc: str, **bounds: float) -> Any:
    """An EngineConfig field with its meaning and bounds (checked by EngineConfig, shown to the serving edge)."""
    return field(default=default, metadata={KNOB: Knob(doc, **bounds)})


def knobs() -> dict[str, Knob]:
    """Every EngineConfig field that is a knob, in declaration order (not `speculative`: a config of its own)."""
    return {f.name: f.metadata[KNOB] for f in fields(EngineConfig) if KNOB in f.metadata}


@dataclass(frozen=True)
class EngineConfig:
    """Knobs of one engine instance.

    max_num_seqs bounds waiting + running requests; queue_size bounds the waiting ones alone. prefill_chunk_tokens
    is mlx-lm's prefill step size per request; prefill_step_tokens bounds all prefilling requests together per step
    (None: measured by EngineCore at load, cut so that a padded step's activations fit the memory left beside the
    weights, the KV budget and the prefix cache).
    """

    max_num_seqs: int = knob(256, "most requests waiting or running at once", ge=1)
    max_prefill_seqs: int = knob(
        32, "most requests prefilling in one step beside decode rows (with none decoding, a burst of up to "
        "max_decode_seqs starts within the step's token budget, in forwards of this many rows)", ge=1)
    max_decode_seqs: int = knob(32, "most requests decoding in one step", ge=1)
    prefill_chunk_tokens: int = knob(
        2048, "most prompt tokens one request prefills per step (0: its whole prompt at once)", ge=0)
    prefill_step_tokens: int | None = knob(
        None, "most prompt tokens all prefilling requests compute per step (0: chunks x max_prefill_seqs; "
        "null: what this device prefills in ~0.5 s, measured at load)", ge=0)
    # A burst's first forwards would otherwise build kernels (runner/prefill_shapes.py).
    pad_prefill_shapes: bool | None = knob(
        None, "pad prefill forwards to a few shapes warmed at load (null: on with a GPU, off on the CPU); "
        "models of plain KV caches only")
    prefill_warmup_seconds: float = knob(
        120.0, "the most seconds the padded shapes' warm-up may take at load (the decode warm-up, on a GPU, at most "
        "30 more)", ge=0)
    slow_step_log_seconds: float = knob(
        0.5, "a step longer than this and than 8 expected steps is logged with what it held (0: every step, a "
        "trace of the engine's steps)", ge=0)
    context_length: int | None = knob(
        None, "the most tokens a request's prompt and output may hold (null: the model's own)", ge=2)
    queue_size: int | None = knob(None, "most requests waiting for a slot (null: only max_num_seqs applies)", ge=0)
    queue_timeout: float | None = knob(
        None, "seconds a request may wait for a slot before it is refused (null: no limit)", gt=0)
    enable_prefix_cache: bool = knob(True, "reuse the KV of prompt prefixes seen before")
    prefix_cache_bytes: int | None = knob(
        None, "the prefix cache's byte budget: 0 or at least 1 MiB (null: a tenth of device memory, "
        "1 GiB where unknown)", ge=0)
    prefix_block_size: int = knob(32, "tokens per prefix-cache block", ge=1)
    # MLX's holdings at load are this model's weights and other models of the process.
    kv_memory_fraction: float = knob(
        0.8, "the running requests' KV budget: this fraction of device memory (RAM on the CPU; at most MLX's "
        "memory limit: 90% of a CUDA card, less what other processes hold on it) less what MLX holds at load and "
        "the prefix cache's and kept vision features' budgets; past it the newest requests are preempted", gt=0, le=1)
    kv_budget_bytes: int | None = knob(None, "the running requests' KV budget itself (instead of kv_memory_fraction)",
                                       ge=1)
    seed: int = knob(0, "seeds the generator that draws the seeds of requests that name none")
    speculative: SpeculativeConfig | None = None  # speculative decoding (engine/spec_decode/); None: off
    kv_bits: int | None = knob(
        None, "quantize the KV cache to 4 or 8 bits (null: the model's dtype); plain KV caches only, "
        "not with speculative decoding")
    kv_group_size: int = knob(64, "values per quantization group of the KV cache: 32, 64 or 128 "
                              "(they must divide the head dimension)")
    max_loras: int = knob(
        4, "most per-request LoRA adapters loaded at once; loading one more unloads the least recently used one "
        "no request runs on (0: none)", ge=0)
    vision_feature_cache_bytes: int | None = knob(
        None, "vision-language models: the vision tower's outputs kept per image across requests (least recently "
        "used out), a byte budget counted beside the KV's (0: none kept; null: 1% of device memory, RAM on the CPU)",
        ge=0)
    max_lora_rank: int = knob(64, "the highest rank a per-request LoRA adapter may have", ge=1)

    def __post_init__(self) -> None:
        if self.prefix_cache_bytes is not None and not (
            self.prefix_cache_bytes == 0 or self.prefix_cache_bytes >= MIN_PREFIX_CACHE_BYTES
        ):
            raise InvalidRequestError(
                "'prefix_cache_bytes' is the prefix cache's byte budget: "
                f"0 or at least {MIN_PREFIX_CACHE_BYTES} (1 MiB), got {self.prefix_cache_bytes}",
                param="prefix_cache_bytes",
            )
        for name, declared in knobs().items():
            problem = declared.problem(name, getattr(self, name))
            if problem is not None:
                raise InvalidRequestError(problem, param=name)
        self._check_kv_quantization()

    def _check_kv_quantization(self) -> None:
        if self.kv_bits is not None and self.kv_bits not in KV_BITS:
            raise InvalidRequestError(f"'kv_bits' must be 4 or 8 (or null: unquantized), got {self.kv_bits}", param="kv_bits")
        if self.kv_group_size not in KV_GROUP_SIZES:
            raise InvalidRequestError(
                f"'kv_group_size' must be 32, 64 or 128, got {self.kv_group_size}", param="kv_group_size")
        if self.kv_bits is not None and self.speculative is not None:
            # Verifying drafts trims rejected positions from the batch, which the quantized batch cannot do yet.
            raise InvalidRequestError("'kv_bits' cannot be combined with 'speculative' decoding yet", param="kv_bits")

    @property
    def kv_quantization(self) -> KVQuantization | None:
        return KVQuantization(self.kv_bits, self.kv_group_size) if self.kv_bits is not None else None

    @property
    def prefill_token_budget(self) -> int | None:
        """Prompt tokens all prefilling requests may compute in one step (None: unbounded, also
        when chunking is off: whole prompts, however long; and before EngineCore has measured it)."""
        return (self.prefill_chunk_tokens and self.prefill_step_tokens) or None

    @property
    def prefill_chunk_limit(self) -> int | None:
        """Prompt tokens one request may compute in one step (None: its whole prompt)."""
        return self.prefill_chunk_tokens or None
