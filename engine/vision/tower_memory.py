"""What the batched vision tower holds while it runs, learnt from its waited runs, so that the images a step runs
through it ahead of admission fit the memory the prefill forwards are sized to (EngineCore._run_towers_ahead).

On an H100, 16 images of 672 x 672 through Qwen2.5-VL-3B's float32 tower in one forward, beside a 32-stream prefill,
ran the card out of memory: the tower's full-attention layers hold every image's scores at once, and nothing had
counted them."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from engine.device_memory import reset_peak_memory


@dataclass
class TowerMemory:
    # The most a waited run held beyond what was allocated before it, per image token it made (None: none seen).
    # The largest ratio, not a mean: a larger image's full attention holds more per token (its scores grow with
    # the square of its patches), and the warm-up's largest size sets it before serving.
    bytes_per_token: float | None = None

    @staticmethod
    def before_run() -> int:
        """Call right before a run that will be waited for: what MLX holds then."""
        held = mx.get_active_memory()
        reset_peak_memory()
        return held

    def note_run(self, held_before: int, tokens: int) -> None:
        """After the run was evaluated: learn what it held beyond held_before for its tokens."""
        if tokens > 0:
            per_token = max(0, mx.get_peak_memory() - held_before) / tokens
            self.bytes_per_token = max(self.bytes_per_token or 0.0, per_token)

    def fits(self, tokens: int, allowance_bytes: int) -> bool:
        """Whether a run making these image tokens fits the allowance, as far as the runs seen tell (any does
        before the first)."""
        return self.bytes_per_token is None or tokens * self.bytes_per_token <= allowance_bytes


__all__ = ["TowerMemory"]
