"""ModelService: owns one engine client; turns GenerateJobs into coalesced StreamChunks. No Ray here.

model/deployment.py wraps it as a Serve deployment (the engine in its own process); ingress/local_models.py runs
it in process (the engine on a thread) for tests and debugging.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Callable

from deployments.chat.output_plan import plan_output
from deployments.output_deltas import ContentDelta, ParsedEvent, ReasoningDelta, ToolCallDelta
from deployments.chat.parsers.selection import OutputParser, ParserNames, resolve_parser_names
from deployments.chat.prompts import EncodedPrompt, PromptEncoder, TokenTexts
from deployments.chat.processed_images import reuse_budget
from deployments.chat.vision_prompts import MediaTokens, VisionPromptEncoder
from deployments.config import ModelConfig
from deployments.metrics.model_metrics import ModelMemory, ModelMetrics, RequestTiming
from deployments.model.adapters import ServiceAdapters
from deployments.model.pixel_sends import EventStream, PixelSends
from deployments.model.vision_warmup import vision_warmup_sizes, warm_vision
from deployments.model_calls import (
    ChatPrompt, EmbedJob, EmbedResult, GenerateJob, MemoryUsage, MetricsSnapshot, ModelInfo, QueueStats,
    StreamChunk, TextPrompt, TextTokenCounts, TextTokensJob, TokenCount,
)
from deployments.transport.chunks import coalesce
from engine.client.interface import EngineClient, StreamEvent
from engine.client.process_client import ProcessEngineClient
from engine.client.spec import EngineSpec
from engine.client.supervisor import SupervisedEngine
from engine.client.thread_client import ThreadEngineClient
from engine.core import EngineStats
from engine.errors import EngineDeadError, InvalidRequestError, ModelUnloadedError, OrchardError
from engine.output.request_output import Admitted, Queued, TextDelta
from engine.request import FinishReason, Request
from engine.process_memory import process_rss_bytes
from engine.runner.memory import EngineMemory
from engine.sampling.params import SamplingParams
from engine.vision.loader import read_media_token_ids

# A child of Serve's logger, so replica log lines carry Serve's request id too.
logger = logging.getLogger("ray.serve.orchard")

# The coalescing window is active streams / advanced.stream_chunks_per_s, within these bounds: every chunk costs
# ~1-2 ms of CPU across replica, ingress and proxy (docs/decisions.md, "Coalescing"), whatever its token count.
MIN_WINDOW_S = 0.02
MAX_WINDOW_S = 0.25
# Prompts are rendered and tokenized in these threads, not on the event loop: the Rust encode releases the
# GIL, so a burst of 512-token prompts (~1-2 ms each) is tokenized side by side while the loop keeps serving.
TOKENIZE_THREADS = 4
# The generic tool format describes tools in full while that takes at most 1/TOOLS_CONTEXT_SHARE of the context,
# else compactly: the conversation needs the rest.
TOOLS_CONTEXT_SHARE = 4

EngineClientFactory = Callable[[ModelConfig], EngineClient]


def engine_spec(config: ModelConfig) -> EngineSpec:
    return EngineSpec(
        model_path=config.model_path,
        model_type=config.model_type,
        uses_default_model=config.uses_default_model,
        dtype=config.dtype,
        chat_template_file=config.chat_template_file,
        trust_remote_code=config.trust_remote_code,
        engine_config=config.engine_config(),
        gil_switch_interval_s=_seconds(config.advanced.gil_switch_interval_ms),
        quantize=config.quantize,
        memory_budget_bytes=config.memory_budget_bytes,
        lora_paths=tuple(config.lora_paths or ()),
        lora_scales=tuple(config.lora_scales or ()),
    )


def process_engine_client(config: ModelConfig) -> EngineClient:
    """The serving path's engine: in a child process of the model's replica."""
    return ProcessEngineClient(engine_spec(config))


def thread_engine_client(config: ModelConfig) -> EngineClient:
    """The engine on a thread of this process (in-process serving for tests and debugging)."""
    return ThreadEngineClient.from_spec(engine_spec(config))


class ModelService:
    def __init__(self, config: ModelConfig, new_engine_client: EngineClientFactory = process_engine_client) -> None:
        self.config = config
        self.model_id = config.id
        # A dead engine is restarted in place (same replica, same config) within a budget.
        self._engine = SupervisedEngine(lambda: new_engine_client(config))
        self.adapters = ServiceAdapters(self.model_id, self._engine, config.adapters, config.max_loras)
        self._prompts: PromptEncoder | None = None
        self._token_texts: TokenTexts | None = None
        self._tokenize_pool = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="orchard-tokenize")
        self.parser_names = ParserNames()
        self.metrics = ModelMetrics(self.model_id)
        self._active_streams = 0
        self._pixel_sends = PixelSends()
        self._unloading = False
        self.created_at = 0

    async def start(self) -> None:
        started = time.monotonic()
        switch_ms = self.config.advanced.gil_switch_interval_ms
        if switch_ms is not None:  # process-wide (under Ray each model has its own)
            sys.setswitchinterval(switch_ms / 1000.0)
        await self._engine.start()
        await self.adapters.start()
        tokenizer = self._engine.served.tokenizer
        self.parser_names = resolve_parser_names(
            self.config.tool_call_parser, self.config.reasoning_parser, getattr(tokenizer, "chat_template", None)
        )
        self._prompts = PromptEncoder(
            tokenizer, tools_in_system_prompt=self.parser_names.tools_in_system_prompt,
            tools_token_budget=self._engine.served.context_length // TOOLS_CONTEXT_SHARE,
            vision=self._vision_encoder(), context_length=self._engine.served.context_length,
        )
        self._token_texts = TokenTexts(tokenizer)
        if self._engine.served.processor is not None:
            await warm_vision(vision_warmup_sizes(self.config), self._encode, self._submit_with_images)
        self.created_at = int(time.time())
        logger.info(
            "model %s ready in %.1f s (tool-call parser %s, reasoning parser %s)", self.model_id,
            time.monotonic() - started, self.parser_names.tool, self.parser_names.reasoning,
        )

    def _submit_with_images(self, request: Request, prompt: EncodedPrompt) -> EventStream:
        """`request` with the prompt's images: a repeated image's pixels left out where the engine keeps its features
        (pixel_sends.py). Users' requests and the vision warm-up's go this one way."""
        request.vision = self._pixel_sends.vision_to_send(prompt.vision, prompt.images_repeated)
        return self._pixel_sends.submit(self._engine.submit, request, prompt.vision)

    def _vision_encoder(self) -> VisionPromptEncoder | None:
        """A multimodal model's image path: its processor (loaded with the tokenizer) and its image token."""
        served = self._engine.served
        if served.processor is None:
            return None
        if not getattr(served.tokenizer, "chat_template", None):  # VLM folders may keep it with the processor
            served.tokenizer.chat_template = getattr(served.processor, "chat_template", None)
        image, video = read_media_token_ids(served.path)
        return VisionPromptEncoder(served.processor, MediaTokens(image, video), self.config.max_image_pixels,
                                   reuse_budget(self.config.processed_image_cache_bytes))

    async def unload(self) -> None:
        """Refuse new requests, give open streams up to advanced.unload_drain_s to finish, then end the rest with
        model_unloaded and stop the engine."""
        self._unloading = True
        deadline = time.monotonic() + self.config.advanced.unload_drain_s
        while self._active_streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._active_streams:
            logger.info("model %s unloaded with %d streams still open", self.model_id, self._active_streams)
        await self.shutdown(ModelUnloadedError(f"The model '{self.model_id}' was unloaded", param="model"))

    async def shutdown(self, error: OrchardError | None = None) -> None:
        """Stop the engine; streams still open end with `error` (EngineDeadError by default)."""
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)
        await self._engine.close(error)

    # ---- generation --------------------------------------------------------
    async def generate(self, job: GenerateJob) -> AsyncIterator[StreamChunk]:
        """Chunks of the job's output; errors (even validation ones) arrive as a last chunk. A streamed job's first
        chunk is its admission (the engine took the request in: nothing can refuse it now, short of a failure)."""
        timing = self.metrics.received()
        try:
            if self._unloading:
                raise ModelUnloadedError(f"The model '{self.model_id}' is being unloaded", param="model")
            prompt = await self._encode(job.prompt)
            plan = plan_output(self.parser_names, job, prompt.text)
            sampling = self._with_max_tokens(plan.sampling, len(prompt.token_ids), job.clamp_max_tokens)
            request = Request(
                job.request_id, prompt.token_ids, sampling, prompt_cache_keys=prompt.cache_keys,
                speculative=job.speculative, adapter=job.adapter.name if job.adapter is not None else None,
                priority=job.priority,
            )
            if job.adapter is None:
                stream = self._submit_with_images(request, prompt)
            else:  # adapters go on text models only (model_type lm): no images
                async with self.adapters.held(job.adapter):
                    stream = self._engine.submit(request)
        except OrchardError as exc:
            logger.info("request %s (%s) refused: %s", job.request_id, job.log_id, exc.message)
            yield StreamChunk(error=exc)
            return
        num_prompt = len(prompt.token_ids)
        logger.info("request %s (%s) started: %d prompt tokens, ready in %.1f ms", job.request_id, job.log_id,
                    num_prompt, (time.monotonic() - timing.received_at) * 1e3)
        self._active_streams += 1
        last: StreamChunk | None = None
        try:
            window = self._window_s if job.stream else _whole_output
            parsed = self._chunks(stream, plan.parser, num_prompt, timing, tell_admission=job.stream)
            # aclosing: a client that goes away closes the chain at once, aborting the request.
            async with contextlib.aclosing(coalesce(parsed, window, hold=stream.hold)) as chunks:
                async for last in chunks:
                    yield last
        finally:
            self._active_streams -= 1
            self.metrics.closed(timing, num_prompt, failed=last is not None and last.error is not None)
            self._log_end(job, last, timing)

    async def _chunks(
        self, stream: AsyncIterator[StreamEvent], parser: OutputParser | None, num_prompt: int, timing: RequestTiming,
        tell_admission: bool,
    ) -> AsyncIterator[StreamChunk]:
        prompt_tokens: int | None = num_prompt  # told once, with the first chunk
        try:
            async for event in stream:
                self.metrics.on_event(timing, event)
                if isinstance(event, (Queued, Admitted)):
                    if not tell_admission:  # a whole response has no use for them
                        continue
                    chunk = _admission_chunk(event)
                elif isinstance(event, TextDelta):
                    chunk = StreamChunk(num_tokens=len(event.token_ids), logprobs=self._texts.logprob_infos(event.logprobs))
                    _add_text(chunk, event.text, parser)
                else:
                    chunk = StreamChunk(finish=event)
                    if parser is not None:
                        _add_events(chunk, parser.finish(cut=event.reason is FinishReason.LENGTH))
                chunk.prompt_tokens, prompt_tokens = prompt_tokens, None
                yield chunk
        except OrchardError as exc:  # queue full / timeout / engine death surface here
            yield StreamChunk(error=exc)

    async def count_tokens(self, prompt: ChatPrompt) -> TokenCount:
        """The prompt tokens a generation request with this prompt would have."""
        try:
            return TokenCount(len((await self._encode(prompt)).token_ids))
        except OrchardError as exc:
            return TokenCount(error=exc)

    async def embed(self, job: EmbedJob) -> EmbedResult:
        return EmbedResult(error=self._not_an_embedding_model())

    async def count_text_tokens(self, job: TextTokensJob) -> TextTokenCounts:
        return TextTokenCounts(error=self._not_an_embedding_model())

    def _not_an_embedding_model(self) -> InvalidRequestError:
        return InvalidRequestError(
            f"The model '{self.model_id}' is a {self.config.model_type} model: /v1/embeddings needs a model of "
            "model_type embedding", param="model",
        )

    async def _encode(self, prompt: ChatPrompt | TextPrompt) -> EncodedPrompt:
        encoder = self._encoder  # raises here, on the loop, if the model has not started
        try:
            work = asyncio.get_running_loop().run_in_executor(self._tokenize_pool, encoder.encode, prompt)
        except RuntimeError as exc:  # the pool refuses new work once shutdown() has begun
            raise EngineDeadError(f"Model '{self.model_id}' is shutting down") from exc
        return await work

    def _with_max_tokens(self, sampling: SamplingParams, num_prompt: int, clamp: bool) -> SamplingParams:
        """A request without max_tokens gets the model's default_max_tokens (cut to the room the prompt leaves:
        a default must not turn a long prompt into an error; nor a KV budget smaller than the context: the room is
        what either leaves); Anthropic's max_tokens is cut to that room too."""
        default = self.config.default_max_tokens
        if sampling.max_tokens is None and default is not None:
            return self._clamped(dataclasses.replace(sampling, max_tokens=default), num_prompt)
        return self._clamped(sampling, num_prompt) if clamp else sampling

    def _clamped(self, sampling: SamplingParams, num_prompt: int) -> SamplingParams:
        served = self._engine.served
        room = min(served.context_length, served.max_request_tokens or served.context_length) - num_prompt
        if sampling.max_tokens is not None and room >= 1 and sampling.max_tokens > room:
            return dataclasses.replace(sampling, max_tokens=room)
        return sampling  # a prompt that leaves no room is refused by the engine, naming it

    def _window_s(self) -> float:
        return min(MAX_WINDOW_S, max(MIN_WINDOW_S, self._active_streams / self.config.advanced.stream_chunks_per_s))

    def _log_end(self, job: GenerateJob, last: StreamChunk | None, timing: RequestTiming) -> None:
        if last is not None and last.finish is not None:
            usage = last.finish.usage
            # From the job's arrival here: a client's TTFT less this is the ingress's and the transport's share.
            first = f", first token after {(timing.first_token_at - timing.received_at) * 1e3:.1f} ms" \
                if timing.first_token_at is not None else ""
            logger.info(
                "request %s (%s) finished: %s, %d prompt + %d completion tokens%s",
                job.request_id, job.log_id, last.finish.reason.value, usage.prompt_tokens, usage.completion_tokens,
                first,
            )
        elif last is not None and last.error is not None:
            logger.info("request %s (%s) failed: %s", job.request_id, job.log_id, last.error.message)
        else:
            logger.info("request %s (%s) cancelled by the client", job.request_id, job.log_id)

    # ---- introspection -----------------------------------------------------
    def info(self) -> ModelInfo:
        served = self._engine.served
        return ModelInfo(
            model_id=self.model_id,
            model_type=self.config.model_type,
            model_path=str(served.path),
            context_length=served.context_length,
            created_at=self.created_at,
            pid=os.getpid(),
            engine_pid=self._engine.pid,
            memory=memory_usage(self._engine.stats().memory, served.in_own_process),
            health=self._engine.health(),
            engine_restarts=self._engine.restarts_total,
            adapters=self.adapters.listing(),
        )

    def queue_stats(self) -> QueueStats:
        stats = self._engine.stats()
        return QueueStats(
            model_id=self.model_id,
            waiting=stats.num_waiting,
            running=stats.num_running,
            decoding=stats.num_decoding,
            max_num_seqs=stats.max_num_seqs,
            queue_size=stats.queue_size,
            kv_cache_bytes=stats.kv_cache_bytes,
            prompt_tokens_total=stats.prompt_tokens_total,
            generation_tokens_total=stats.generation_tokens_total,
            tokens_per_s=round(stats.generation_tokens_per_s, 2),
            steps_total=stats.num_steps,
            step_seconds_total=round(stats.step_seconds_total, 4),
            step_cpu_seconds_total=round(stats.step_cpu_seconds_total, 4),
            process_cpu_seconds_total=round(self._process_cpu_seconds(stats), 4),
            speculation=stats.speculation,
            vision_tower_images_total=stats.vision_tower.images if stats.vision_tower else None,
            vision_tower_seconds_total=round(stats.vision_tower.seconds, 4) if stats.vision_tower else None,
        )

    def metrics_snapshot(self) -> MetricsSnapshot:
        """The model's metrics, its engine's levels read now (GET /metrics; Ray's export refreshes with it). An engine
        that has none to give (dead, not started) leaves the last levels read, and the requests' counts still go."""
        try:
            stats = self._engine.stats()
            in_own_process = self._engine.served.in_own_process
        except OrchardError:
            return self.metrics.recorder.snapshot()
        engine = stats.memory
        rss = engine.rss_bytes + (process_rss_bytes() if in_own_process else 0)
        memory = ModelMemory(engine.mlx_active_bytes, engine.mlx_cache_bytes, engine.mlx_peak_bytes, rss)
        return self.metrics.snapshot(stats, self._engine.restarts_total, memory)

    def _process_cpu_seconds(self, stats: EngineStats) -> float:
        """CPU seconds of the processes serving this model: this one, and the engine's if it has its own."""
        if self._engine.served.in_own_process:
            return time.process_time() + stats.process_cpu_seconds
        return stats.process_cpu_seconds

    @property
    def engine_pid(self) -> int | None:
        """The engine process's pid (None: the engine runs on a thread of this process)."""
        return self._engine.pid

    @property
    def _encoder(self) -> PromptEncoder:
        if self._prompts is None:
            raise EngineDeadError(f"Model '{self.model_id}' has not started")
        return self._prompts

    @property
    def _texts(self) -> TokenTexts:
        assert self._token_texts is not None
        return self._token_texts


def _seconds(milliseconds: float | None) -> float | None:
    return None if milliseconds is None else milliseconds / 1000.0


def _admission_chunk(event: Queued | Admitted) -> StreamChunk:
    if isinstance(event, Queued):
        return StreamChunk(queued=True)
    return StreamChunk(queued=True, admitted=True, cached_tokens=event.cached_tokens)


def _whole_output() -> None:
    return None


def _add_text(chunk: StreamChunk, text: str, parser: OutputParser | None) -> None:
    if parser is None:
        chunk.text += text
    elif text:
        _add_events(chunk, parser.feed(text))


def _add_events(chunk: StreamChunk, events: list[ParsedEvent]) -> None:
    for event in events:
        if isinstance(event, ContentDelta):
            chunk.merge(StreamChunk(text=event.text))
        elif isinstance(event, ReasoningDelta):
            chunk.merge(StreamChunk(reasoning=event.text))
        elif isinstance(event, ToolCallDelta):
            chunk.merge(StreamChunk(tool_calls=[event]))


MIB = 1024 * 1024


def memory_usage(engine: EngineMemory, engine_in_own_process: bool) -> MemoryUsage:
    """A model's memory as the API reports it: the engine process's MLX counters and RSS (plus, where the engine
    steps in a child process, this serving process's RSS)."""
    rss = engine.rss_bytes + (process_rss_bytes() if engine_in_own_process else 0)
    total = rss if engine.buffers_in_rss else rss + engine.mlx_active_bytes
    return MemoryUsage(
        mlx_active_mb=round(engine.mlx_active_bytes / MIB, 1),
        mlx_cache_mb=round(engine.mlx_cache_bytes / MIB, 1),
        mlx_peak_mb=round(engine.mlx_peak_bytes / MIB, 1),
        rss_mb=round(rss / MIB, 1),
        total_mb=round(total / MIB, 1),
    )
