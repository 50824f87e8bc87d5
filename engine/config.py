"""Engine configuration (our names; Bodega's aliases are mapped by deployments/bodega.py)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import InvalidRequestError
from engine.kv.quantization import KV_BITS, KV_GROUP_SIZES, KVQuantization
from engine.spec_decode.config import SpeculativeConfig

MIN_PREFIX_CACHE_BYTES = 1 << 20


@dataclass(frozen=True)
class EngineConfig:
    """Knobs of one engine instance.

    max_num_seqs bounds waiting + running requests; queue_size bounds the waiting
    ones alone (None: only max_num_seqs applies). prefill_chunk_tokens is the most
    prompt tokens one request prefills per step (0: whole prompts in one step), as
    mlx-lm's prefill step size; prefill_step_tokens bounds all prefilling requests
    together per step (0: only chunks x max_prefill_seqs; None: what this device
    prefills in about half a second, measured by EngineCore at load, cut so that a
    padded step's activations fit the memory left beside the weights, the KV budget
    and the prefix cache).
    """

    max_num_seqs: int = 256
    max_prefill_seqs: int = 32
    max_decode_seqs: int = 32
    prefill_chunk_tokens: int = 2048
    prefill_step_tokens: int | None = None
    # Pad prefill forwards to a few lengths and warm them at load (runner/prefill_shapes.py);
    # None: on with a GPU, off on the CPU (where padding only costs). Models with plain KV caches only.
    pad_prefill_shapes: bool | None = None
    prefill_warmup_seconds: float = 120.0
    context_length: int | None = None
    queue_size: int | None = None
    queue_timeout: float | None = None
    enable_prefix_cache: bool = True
    # Byte budget of cached prompt KV; None: a tenth of device memory (1 GiB where unknown).
    prefix_cache_bytes: int | None = None
    prefix_block_size: int = 32
    # The running requests' KV budget: this fraction of device memory (the machine's RAM on the CPU), less what
    # MLX holds at load (this model's weights, other models of the process) and the prefix cache's budget.
    # kv_budget_bytes sets the budget itself instead (operators, tests).
    kv_memory_fraction: float = 0.8
    kv_budget_bytes: int | None = None
    # Run the model in this dtype ("float32", "bfloat16", "float16"); None keeps the weights'.
    dtype: str | None = None
    seed: int = 0
    # Speculative decoding (engine/spec_decode/); None: off.
    speculative: SpeculativeConfig | None = None
    # Quantized KV cache (engine/kv/quantized_kv.py): 4 or 8 bits in groups of kv_group_size; None: the model's dtype.
    kv_bits: int | None = None
    kv_group_size: int = 64

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_prefill_seqs", "max_decode_seqs"):
            if getattr(self, name) < 1:
                raise InvalidRequestError(f"'{name}' must be >= 1", param=name)
        for name in ("prefill_chunk_tokens", "prefill_step_tokens"):
            if (getattr(self, name) or 0) < 0:
                raise InvalidRequestError(f"'{name}' must be >= 0", param=name)
        if self.context_length is not None and self.context_length < 2:
            raise InvalidRequestError("'context_length' must be >= 2", param="context_length")
        if self.queue_size is not None and self.queue_size < 0:
            raise InvalidRequestError("'queue_size' must be >= 0", param="queue_size")
        if self.prefix_cache_bytes is not None and not (
            self.prefix_cache_bytes == 0 or self.prefix_cache_bytes >= MIN_PREFIX_CACHE_BYTES
        ):
            raise InvalidRequestError(
                "'prefix_cache_bytes' is the prefix cache's byte budget: "
                f"0 or at least {MIN_PREFIX_CACHE_BYTES} (1 MiB), got {self.prefix_cache_bytes}",
                param="prefix_cache_bytes",
            )
        if self.prefix_block_size < 1:
            raise InvalidRequestError("'prefix_block_size' must be >= 1", param="prefix_block_size")
        if not 0 < self.kv_memory_fraction <= 1:
            raise InvalidRequestError(
                f"'kv_memory_fraction' must be in (0, 1], got {self.kv_memory_fraction}", param="kv_memory_fraction"
            )
        if self.kv_budget_bytes is not None and self.kv_budget_bytes < 1:
            raise InvalidRequestError("'kv_budget_bytes' must be >= 1", param="kv_budget_bytes")
        if self.prefill_warmup_seconds < 0:
            raise InvalidRequestError("'prefill_warmup_seconds' must be >= 0", param="prefill_warmup_seconds")
        if self.queue_timeout is not None and self.queue_timeout <= 0:
            raise InvalidRequestError("'queue_timeout' must be > 0 seconds", param="queue_timeout")
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
