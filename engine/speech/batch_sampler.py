"""The next token of every active window at once: Whisper's suppressions and timestamp rules as one batched mask
(ranges from timestamp_rules.py), then greedy or temperature sampling per window. MLX."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from engine.speech.timestamp_rules import MAX_RANGES, Forbidden


class BatchSampler:
    def __init__(self, vocab: int, suppressed: tuple[int, ...], timestamp_begin: int) -> None:
        mask = np.zeros(vocab, np.float32)
        mask[list(suppressed)] = -np.inf
        self.suppress = mx.array(mask)
        self.timestamp_begin = timestamp_begin
        self.ids = mx.arange(vocab)
        mx.eval(self.suppress, self.ids)  # now: an array left lazy belongs to this thread's stream, not the engine's

    def sample(self, logits: mx.array, forbidden: list[Forbidden], temperatures: list[float],
               key: mx.array | None = None) -> tuple[list[int], list[float]]:
        """Tokens and their log-probabilities (under the masked distribution) for the n rows of `logits`."""
        logits = self._masked(logits + self.suppress, forbidden)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        temps = mx.array(temperatures, dtype=mx.float32)
        greedy = mx.argmax(logits, axis=-1)
        if any(t > 0 for t in temperatures):
            drawn = mx.random.categorical(logits / mx.maximum(temps, 1e-6)[:, None], key=key)
            tokens = mx.where(temps > 0, drawn, greedy)
        else:
            tokens = greedy
        chosen = mx.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
        mx.eval(tokens, chosen)
        return tokens.tolist(), chosen.tolist()

    def _masked(self, logits: mx.array, forbidden: list[Forbidden]) -> mx.array:
        lo = np.zeros((len(forbidden), MAX_RANGES), np.int32)
        hi = np.zeros((len(forbidden), MAX_RANGES), np.int32)
        for row, rule in enumerate(forbidden):
            for slot, (start, end) in enumerate(rule.ranges[:MAX_RANGES]):
                lo[row, slot], hi[row, slot] = start, end
        ids = self.ids[None, None, :]
        banned = ((ids >= mx.array(lo)[:, :, None]) & (ids < mx.array(hi)[:, :, None])).any(axis=1)
        logits = mx.where(banned, -mx.inf, logits)
        rule_rows = mx.array([rule.timestamp_rule for rule in forbidden])
        if not any(rule.timestamp_rule for rule in forbidden):
            return logits
        # Timestamps together more likely than any one text token: sample a timestamp (OpenAI's rule).
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        stamp = mx.logsumexp(logprobs[:, self.timestamp_begin:], axis=-1)
        text = mx.max(logprobs[:, :self.timestamp_begin], axis=-1)
        prefer_stamp = rule_rows & (stamp > text)
        is_text = self.ids[None, :] < self.timestamp_begin
        return mx.where(prefer_stamp[:, None] & is_text, -mx.inf, logits)
