"""What a quantized KV cache is configured with (config kv_bits / kv_group_size): plain Python, no MLX, so that
the engine config and the scheduler import it without MLX (quantized_kv.py is the MLX side)."""

from __future__ import annotations

from dataclasses import dataclass

KV_BITS = (4, 8)
KV_GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True)
class KVQuantization:
    bits: int
    group_size: int

    def bytes_per_token(self, num_kv_heads: int, head_dim: int, scale_bytes: int = 2) -> int:
        """Bytes one layer holds per token: keys and values of every KV head, packed at `bits`, plus a scale and
        a bias (in the activations' dtype, `scale_bytes` each) per group of `group_size`."""
        per_vector = head_dim * self.bits // 8 + 2 * scale_bytes * (head_dim // self.group_size)
        return 2 * num_kv_heads * per_vector
