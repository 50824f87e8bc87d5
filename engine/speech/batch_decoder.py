"""Whisper's decoder over many windows at once: each window holds a slot of fixed caches, and one step decodes a
token for every active slot. MLX only; what to sample and when a window ends is the scheduler's (speech_engine.py).

Slots keep self-attention keys/values (n_text_ctx positions) and cross-attention keys/values (the window's encoder
output projected once, at admission). Active windows always fill the slots' prefix [0, n): a step reads the caches
as contiguous slices, and a window that ends hands its slot to the last active one (release()). The forward is
mlx-audio's decoder block by block (its weights and layers), with per-row positions and a length mask in place of
its single-sequence cache."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_audio.stt.models.whisper.whisper import Model, ResidualAttentionBlock


class SlotCaches:
    def __init__(self, model: Model, slots: int, dtype: mx.Dtype) -> None:
        dims = model.dims
        self.slots = slots
        layers = dims.n_text_layer
        self.self_k = [mx.zeros((slots, dims.n_text_ctx, dims.n_text_state), dtype) for _ in range(layers)]
        self.self_v = [mx.zeros((slots, dims.n_text_ctx, dims.n_text_state), dtype) for _ in range(layers)]
        self.cross_k = [mx.zeros((slots, dims.n_audio_ctx, dims.n_text_state), dtype) for _ in range(layers)]
        self.cross_v = [mx.zeros((slots, dims.n_audio_ctx, dims.n_text_state), dtype) for _ in range(layers)]
        mx.eval(self.self_k, self.self_v, self.cross_k, self.cross_v)

    @classmethod
    def empty(cls) -> "SlotCaches":
        caches = cls.__new__(cls)
        caches.slots, caches.self_k, caches.self_v, caches.cross_k, caches.cross_v = 0, [], [], [], []
        return caches

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for group in (self.self_k, self.self_v, self.cross_k, self.cross_v) for a in group)

    def arrays(self) -> list[mx.array]:
        return [*self.self_k, *self.self_v, *self.cross_k, *self.cross_v]

    def move(self, source: int, target: int) -> None:
        """Slot `source`'s caches into slot `target` (a window that ended gives its slot to the last active one)."""
        for group in (self.self_k, self.self_v, self.cross_k, self.cross_v):
            for layer, cache in enumerate(group):
                cache[target] = cache[source]


class BatchDecoder:
    def __init__(self, model: Model, slots: int, dtype: mx.Dtype) -> None:
        self.model = model
        self.decoder = model.decoder
        self.heads = model.dims.n_text_head
        self.caches = SlotCaches(model, slots, dtype)

    def close(self) -> None:
        """Free the caches (on the thread that last wrote them)."""
        self.caches = SlotCaches.empty()

    def encode(self, mels: mx.array) -> mx.array:
        """Windows' log-mel features (B, 3000, n_mels) -> encoder outputs (B, n_audio_ctx, n_audio_state)."""
        return self.model.encoder(mels.astype(self.caches.self_k[0].dtype))

    def admit(self, slot: int, audio: mx.array) -> None:
        """Project one window's encoder output (n_audio_ctx, state) into slot `slot`'s cross-attention caches."""
        for layer, block in enumerate(self.decoder.blocks):
            self.caches.cross_k[layer][slot] = block.cross_attn.key(audio)
            self.caches.cross_v[layer][slot] = block.cross_attn.value(audio)

    def prefill(self, slot: int, tokens: list[int], start: int) -> mx.array:
        """Feed `tokens` at positions start.. of slot `slot`; the logits at each fed position, (len(tokens), V)."""
        count = len(tokens)
        positions = mx.arange(start, start + count)
        x = self.decoder.token_embedding(mx.array(tokens)[None]) + self.decoder.positional_embedding[positions][None]
        # Causal over the whole context written so far: position p sees 0..p.
        visible = mx.arange(start + count)[None, :] <= positions[:, None]
        mask = mx.where(visible, 0.0, -mx.inf).astype(x.dtype)[None, None]
        rows = mx.array([slot])
        for layer, block in enumerate(self.decoder.blocks):
            x = self._block(block, layer, x, rows, slot, positions[None], start + count, mask)
        return self._logits(x)[0]

    def step(self, tokens: list[int], positions: list[int]) -> mx.array:
        """One token for each of the active slots 0..n-1 (token i at position positions[i]); logits (n, V)."""
        count = len(tokens)
        rows = mx.arange(count)
        where = mx.array(positions)
        x = self.decoder.token_embedding(mx.array(tokens)[:, None]) + self.decoder.positional_embedding[where][:, None]
        length = max(positions) + 1
        visible = mx.arange(length)[None, :] <= where[:, None]
        mask = mx.where(visible, 0.0, -mx.inf).astype(x.dtype)[:, None, None, :]
        for layer, block in enumerate(self.decoder.blocks):
            x = self._block(block, layer, x, rows, 0, where[:, None], length, mask)
        return self._logits(x)[:, 0]

    def _block(self, block: ResidualAttentionBlock, layer: int, x: mx.array, rows: mx.array, first: int,
               positions: mx.array, length: int, mask: mx.array) -> mx.array:
        """One decoder block for the slots `rows` (B, contiguous from `first`) whose tokens sit at `positions`
        (B, T); the self-attention caches are read up to `length`."""
        h = block.attn_ln(x)
        k_cache, v_cache = self.caches.self_k[layer], self.caches.self_v[layer]
        k_cache[rows[:, None], positions] = block.attn.key(h)
        v_cache[rows[:, None], positions] = block.attn.value(h)
        keys = k_cache[first:first + rows.size, :length]
        values = v_cache[first:first + rows.size, :length]
        x = x + block.attn.out(self._attend(block.attn.query(h), keys, values, mask))
        h = block.cross_attn_ln(x)
        keys = self.caches.cross_k[layer][first:first + rows.size]
        values = self.caches.cross_v[layer][first:first + rows.size]
        x = x + block.cross_attn.out(self._attend(block.cross_attn.query(h), keys, values, None))
        return x + block.mlp2(nn.gelu(block.mlp1(block.mlp_ln(x))))

    def _attend(self, q: mx.array, k: mx.array, v: mx.array, mask: mx.array | None) -> mx.array:
        batch, count, state = q.shape
        head_dim = state // self.heads

        def heads(a: mx.array) -> mx.array:
            return a.reshape(a.shape[0], a.shape[1], self.heads, head_dim).transpose(0, 2, 1, 3)

        out = mx.fast.scaled_dot_product_attention(heads(q), heads(k), heads(v), scale=head_dim ** -0.5, mask=mask)
        return out.transpose(0, 2, 1, 3).reshape(batch, count, state)

    def _logits(self, x: mx.array) -> mx.array:
        return self.decoder.token_embedding.as_linear(self.decoder.ln(x)).astype(mx.float32)
