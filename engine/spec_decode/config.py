"""How a model speculates (plain Python; deployments map serve_config.yaml and Bodega's fields onto it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from engine.errors import InvalidRequestError

MAX_DRAFT_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """method "ngram": drafts copied from the request's own text after the longest earlier match of its last
    min_match..max_match tokens (prompt lookup); "draft": a smaller model of the same tokenizer drafts greedily.

    num_draft_tokens is the most tokens a row drafts per step; each row's length then follows its measured
    acceptance (adaptive.py). max_verify_tokens bounds the positions one verifying forward computes over the
    whole batch (rows x (1 + drafts)): past it decode is compute-bound and drafts cost more than they save
    (None: from the device, engine/spec_decode/adaptive.py). adaptive False: every row drafts num_draft_tokens
    whenever it may (no acceptance or cost tracking; for reproducible step counts and for measuring).
    """

    method: Literal["ngram", "draft"] = "ngram"
    num_draft_tokens: int = 4
    min_match: int = 2
    max_match: int = 4
    draft_model_path: str | None = None
    max_verify_tokens: int | None = None
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "draft"):
            raise InvalidRequestError("'speculative.method' must be 'ngram' or 'draft'", param="speculative.method")
        if not 1 <= self.num_draft_tokens <= MAX_DRAFT_TOKENS:
            raise InvalidRequestError(
                f"'num_draft_tokens' must be 1..{MAX_DRAFT_TOKENS}, got {self.num_draft_tokens}", param="num_draft_tokens"
            )
        if not 1 <= self.min_match <= self.max_match:
            raise InvalidRequestError(
                "'speculative.min_match' must be >= 1 and <= 'speculative.max_match'", param="speculative.min_match"
            )
        if (self.method == "draft") != (self.draft_model_path is not None):
            raise InvalidRequestError(
                "method 'draft' needs 'draft_model_path', and 'draft_model_path' needs method 'draft'",
                param="draft_model_path",
            )
        if self.max_verify_tokens is not None and self.max_verify_tokens < 2:
            raise InvalidRequestError("'speculative.max_verify_tokens' must be >= 2", param="speculative.max_verify_tokens")
