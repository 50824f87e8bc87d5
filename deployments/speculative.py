"""A model's `speculative:` field (serve_config.yaml / admin load-model) and its engine config.

Bodega's `draft_model_path` / `num_draft_tokens` are mapped onto it by deployments/bodega.py.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.spec_decode.config import MAX_DRAFT_TOKENS, SpeculativeConfig


class SpeculativeOptions(BaseModel):
    """Speculative decoding for one model (null or absent: off). Output is exactly the model's own either way;
    each request may opt out with `speculative: false`.

    method "ngram": prompt lookup, drafts copied from the request's own text (no second model); "draft": a smaller
    model with the same tokenizer drafts (`draft_model_path`: a local model folder, or a Hugging Face repo id
    already in the local cache). Unset: "draft" when draft_model_path is given, else "ngram".
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    method: Literal["ngram", "draft"] | None = Field(
        None, description="ngram: prompt lookup, drafts copied from the request's own text; draft: a smaller model "
        "of the same tokenizer drafts (null: draft when draft_model_path is given, else ngram)")
    num_draft_tokens: int = Field(
        SpeculativeConfig.num_draft_tokens, ge=1, le=MAX_DRAFT_TOKENS,
        description="the most tokens a request drafts per step (each request's length then follows its acceptance)",
    )
    min_match: int = Field(SpeculativeConfig.min_match, ge=1, description="ngram: shortest suffix looked up")
    max_match: int = Field(SpeculativeConfig.max_match, ge=1, description="ngram: longest suffix looked up")
    draft_model_path: str | None = Field(
        None, min_length=1, description="method draft: a local model folder, or a Hugging Face repo id already in "
        "the local cache")
    max_verify_tokens: int | None = Field(
        None, ge=2, description="positions one verifying forward may compute over the batch (null: from the device)"
    )
    adaptive: bool = Field(
        True, description="false: always draft num_draft_tokens (no per-request lengths from acceptance and measured cost)"
    )

    @model_validator(mode="after")
    def _consistent(self) -> SpeculativeOptions:
        if self.method is None:
            self.method = "draft" if self.draft_model_path is not None else "ngram"
        if self.method == "draft" and self.draft_model_path is None:
            raise ValueError("speculative.method 'draft' needs 'speculative.draft_model_path'")
        if self.method == "ngram" and self.draft_model_path is not None:
            raise ValueError("'speculative.draft_model_path' is for method 'draft', not 'ngram'")
        if self.min_match > self.max_match:
            raise ValueError(
                f"'speculative.min_match' ({self.min_match}) must be <= 'speculative.max_match' ({self.max_match})"
            )
        return self

    def engine_config(self) -> SpeculativeConfig:
        assert self.method is not None  # filled by the validator
        return SpeculativeConfig(
            method=self.method,
            num_draft_tokens=self.num_draft_tokens,
            min_match=self.min_match,
            max_match=self.max_match,
            draft_model_path=self.draft_model_path,
            max_verify_tokens=self.max_verify_tokens,
            adaptive=self.adaptive,
        )
