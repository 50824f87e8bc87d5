"""Per-request sampling parameters and their validation."""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral, Real

from engine.errors import InvalidRequestError
from engine.sampling.guided import GuidedDecoding

MAX_TOP_LOGPROBS = 20
# The sampler holds per-row numbers in 32-bit device arrays: a value beyond these cannot be represented there.
INT32_MAX = 2**31 - 1
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32: a positive value below it rounds towards 0
_UINT32 = 2**32


def _fail(param: str, message: str) -> None:
    raise InvalidRequestError(f"Invalid '{param}': {message}", param=param)


def _is_int(value: object) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _is_float32(value: object) -> bool:
    """A real number a float32 holds without overflow (no NaN, no infinity; a huge int is not one either)."""
    return isinstance(value, Real) and not isinstance(value, bool) and -FLOAT32_MAX <= value <= FLOAT32_MAX


@dataclass(frozen=True)
class SamplingParams:
    """What the caller asked for; validated once, read-only afterwards.

    `max_tokens=None` means "until the context is full"; the engine resolves it.
    """

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    # Structured output: the text generated must match this (None: free text).
    guided: GuidedDecoding | None = None
    # False keeps special tokens in the text (output parsers read markers that are special tokens).
    skip_special_tokens: bool = True

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def needs_token_history(self) -> bool:
        """Penalties and guides read the tokens generated so far, so they need them before the next step."""
        return self.has_penalties or self.guided is not None

    def validate(self, vocab_size: int) -> None:
        """Refuse what the sampler cannot represent or the model cannot index (each error names its field)."""
        self._validate_lengths(vocab_size)
        self._validate_distribution()
        self._validate_penalties()
        self._validate_tokens(vocab_size)

    def _validate_lengths(self, vocab_size: int) -> None:
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            _fail("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        most_logprobs = min(MAX_TOP_LOGPROBS, vocab_size)
        if not _is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= most_logprobs:
            _fail("top_logprobs", f"must be an integer between 0 and {most_logprobs}, got {self.top_logprobs!r}")
        if self.seed is not None and not _is_int(self.seed):
            _fail("seed", "must be an integer")
        for text in self.stop:
            if not isinstance(text, str) or not text:
                _fail("stop", "stop strings must be non-empty strings")

    def _validate_distribution(self) -> None:
        if not (_is_float32(self.temperature) and self.temperature >= 0.0):
            _fail("temperature", f"must be a finite number >= 0, got {self.temperature!r}")
        if not (_is_float32(self.top_p) and 0.0 < self.top_p <= 1.0):
            _fail("top_p", f"must be in (0, 1], got {self.top_p!r}")
        # A top_k at or above the vocabulary keeps every token (the sampler clamps it), but it must fit in int32.
        if not _is_int(self.top_k) or not -1 <= self.top_k <= INT32_MAX:
            _fail("top_k", f"must be an integer between 0 and {INT32_MAX} (or -1 to disable), got {self.top_k!r}")
        if not (_is_float32(self.min_p) and 0.0 <= self.min_p <= 1.0):
            _fail("min_p", f"must be in [0, 1], got {self.min_p!r}")

    def _validate_penalties(self) -> None:
        # Positive logits are divided by it: below float32's normal range the quotient overflows.
        if not (_is_float32(self.repetition_penalty) and self.repetition_penalty >= FLOAT32_TINY):
            _fail("repetition_penalty", f"must be a finite number > 0, got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (_is_float32(value) and -2.0 <= value <= 2.0):
                _fail(name, f"must be between -2 and 2, got {value!r}")

    def _validate_tokens(self, vocab_size: int) -> None:
        for token_id, bias in self.logit_bias:
            if not _is_int(token_id) or not 0 <= token_id < vocab_size:
                _fail("logit_bias", f"token id {token_id!r} is outside the vocabulary (0..{vocab_size - 1})")
            if not (_is_float32(bias) and -100.0 <= bias <= 100.0):
                _fail("logit_bias", f"bias for token {token_id} must be between -100 and 100")
        for token_id in self.stop_token_ids:
            if not _is_int(token_id) or not 0 <= token_id < vocab_size:
                _fail("stop_token_ids", f"token id {token_id!r} is outside the vocabulary (0..{vocab_size - 1})")


def seed_to_uint32(seed: int) -> int:
    return seed % _UINT32


def make_logit_bias(mapping: dict[int | str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI sends logit_bias keys as strings; normalise to sorted int pairs."""
    if not mapping:
        return ()
    try:
        pairs = sorted((int(k), float(v)) for k, v in mapping.items())
    except (TypeError, ValueError):
        _fail("logit_bias", "keys must be token ids and values numbers")
    return tuple(pairs)


__all__ = ["INT32_MAX", "MAX_TOP_LOGPROBS", "SamplingParams", "make_logit_bias", "seed_to_uint32"]
