"""The Embedder protocol over an in-process sentence-transformers model (tests, benches; torch is an optional extra)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import numpy as np


class SentenceTransformerEmbedder:
    def __init__(self, model_dir: str | Path, device: str = "cpu") -> None:
        # Imported here: torch stays out of the core import path.
        from sentence_transformers import SentenceTransformer

        self.model = SentenceTransformer(str(model_dir), device=device)
        # One encode at a time: the model is not documented as safe to run from several threads at once.
        self._lock = threading.Lock()

    async def embed(self, texts: list[str]) -> np.ndarray:
        return await asyncio.to_thread(self._encode, texts)

    def _encode(self, texts: list[str]) -> np.ndarray:
        with self._lock:
            vectors = self.model.encode(texts, batch_size=64, normalize_embeddings=True, convert_to_numpy=True)
        return np.asarray(vectors, dtype=np.float32)

    async def count_tokens(self, texts: list[str]) -> list[int]:
        if not texts:
            return []
        return [len(ids) for ids in self.model.tokenizer(texts, add_special_tokens=False)["input_ids"]]
