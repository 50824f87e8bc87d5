"""EngineCore: schedule ▸ run ▸ sample ▸ update ▸ emit, one step at a time on the caller's thread (the previous
step's update runs on the runner's worker thread while this step launches, and is done before step() returns)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from engine.adapters.registry import LoadedAdapter
from engine.adapters.served import ServedAdapters
from engine.config import EngineConfig
from engine.device_memory import headroom_bytes, memory_reading
from engine.errors import InvalidRequestError
from engine.kv.block_store import new_prefix_cache
from engine.kv.budget import KV_ALLOCATION_STEP, KVBudget
from engine.kv.cache_manager import KVCacheManager, PrefixCache, PrefixCacheStats
from engine.kv.kv_layout import default_kv_budget_bytes, kv_bytes_per_token, prefill_memory_allowance_bytes
from engine.kv.quantized_kv import check_quantizable
from engine.models.loader import LoadedModel
from engine.output.detokenizer import text_source_factory
from engine.output.request_output import RequestOutput, RequestOutputState
from engine.request import Request, RequestStatus, adapter_cache_keys
from engine.request_limits import RequestLimits
from engine.runner.memory import EngineMemory, read_engine_memory, vision_features_budget
from engine.runner.runner import ModelRunner
from engine.runner.step_budget import STEP_TARGET_S, measure_prefill_budget
from engine.runner.vision_prefill import vision_cost_tokens
from engine.runner.verify_step import new_speculative_decoder
from engine.runner_output import RunnerOutput, SampledToken
from engine.sampling.held_guides import HeldGuides
from engine.sampling.structured import GuideCompileStats, GuideCompiler
from engine.scheduler.scheduler import Scheduler
from engine.scheduler_output import SchedulerOutput
from engine.spec_decode.speculator import SpeculationStats
from engine.vision.feature_cache import FeatureCacheStats, VisionTowerStats
from engine.vision.model import VisionLanguageModel

THROUGHPUT_WINDOW_S = 10.0

logger = logging.getLogger(__name__)


@dataclass
class StepPhaseSeconds:
    """Where the engine thread's step time goes, summed over steps (bench/engine_throughput.py shows it per step)."""

    schedule: float = 0.0  # the scheduler, admissions and prefix-cache copies, before the runner
    # the runner's Python: building the step's forward and sampling, handing them to the device (with the previous
    # step's outputs made on a worker thread beside that launch)
    build: float = 0.0
    wait: float = 0.0  # blocked on the device for sampled tokens: device time the pipelining did not hide
    output: float = 0.0  # after the runner: detokenizing, stop checks, outputs of what the runner returned


@dataclass
class EngineStats:
    num_waiting: int
    num_running: int
    num_decoding: int
    max_num_seqs: int
    queue_size: int | None
    kv_cache_bytes: int
    num_steps: int
    # Wall and engine-thread CPU seconds inside step(): their ratio per step tells a device- or
    # GIL-bound step (wall >> CPU) from a Python-bound one.
    step_seconds_total: float
    step_cpu_seconds_total: float
    prompt_tokens_total: int
    generation_tokens_total: int
    generation_tokens_per_s: float
    # The engine process's CPU seconds (all threads) and memory, read with the stats.
    process_cpu_seconds: float
    memory: EngineMemory
    # None when the prefix cache is off (disabled, or a model whose caches cannot be cut into blocks).
    prefix_cache: PrefixCacheStats | None = None
    # How long a step should take at most here (None: not measured): EngineClient.health() calls an engine
    # whose steps stop ending for many times this long degraded.
    expected_step_s: float | None = None
    # None when the model does not speculate.
    speculation: SpeculationStats | None = None
    guide_compiles: GuideCompileStats | None = None
    step_phases: StepPhaseSeconds = field(default_factory=StepPhaseSeconds)
    # The running requests' KV budget (bytes, and bytes per token), the KV the last step was planned to hold,
    # preemptions so far and the preempted requests waiting to resume.
    kv_budget_bytes: int = 0
    kv_bytes_per_token: int = 0
    kv_planned_bytes: int = 0
    num_preemptions: int = 0
    num_preempted: int = 0
    # Vision-language models: the vision tower's kept outputs (None: a text model).
    vision_features: FeatureCacheStats | None = None
    vision_tower: VisionTowerStats | None = None


class EngineCore:
    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None, draft: LoadedModel | None = None) -> None:
        self.loaded = loaded
        config = config or EngineConfig()
        self.context_length = config.context_length or loaded.context_length
        self.expected_step_s: float | None = None
        if config.kv_quantization is not None:  # refused at load, before anything builds a quantized cache
            check_quantizable(loaded.model, config.kv_quantization, vision=isinstance(loaded.model, VisionLanguageModel))
        prefix_cache = new_prefix_cache(
            loaded.model, config.enable_prefix_cache, config.prefix_block_size, config.prefix_cache_bytes
        )
        self.kv_budget = _kv_budget(loaded, config, prefix_cache, draft)
        # What a forward may hold beside the weights and the budgets: a prefill step's, a batch of towers run ahead.
        self.forward_allowance_bytes = prefill_memory_allowance_bytes(
            self.kv_budget.budget_bytes, _held_budgets_bytes(loaded, config, prefix_cache))
        if config.prefill_step_tokens is None:  # from this device's speed and memory, before anything sizes by it
            budget = measure_prefill_budget(
                loaded.model, self.context_length, config.kv_quantization, self.forward_allowance_bytes,
                config.max_prefill_seqs, config.prefill_chunk_limit,
            )
            config = replace(config, prefill_step_tokens=budget.step_tokens)
            self.expected_step_s = budget.expected_step_s
        self.config = config
        # A configured step budget is taken as STEP_TARGET_S of prefill (what a measured one is).
        self._prefill_tokens_per_s = (config.prefill_token_budget or 0) / (self.expected_step_s or STEP_TARGET_S)
        # What every request is checked against, by the engine client before it reaches this core.
        self.limits = RequestLimits(loaded.vocab_size, self.context_length, self.kv_budget, loaded.longest_token_chars)
        speculation = new_speculative_decoder(loaded, config.speculative, draft)
        guides = HeldGuides()  # compiled guides by key: held by the scheduler, resolved by the runner
        vision = isinstance(loaded.model, VisionLanguageModel)
        self.adapters = ServedAdapters(loaded.model, config.max_loras, config.max_lora_rank,
                                       refused="a vision-language model (text models only)" if vision else None)
        self.runner = ModelRunner(loaded, config, guides, prefix_cache, speculation, self.adapters)
        self.scheduler = Scheduler(config, kv=KVCacheManager(prefix_cache), kv_budget=self.kv_budget, guides=guides)
        self._states: dict[str, RequestOutputState] = {}
        self._towers_ahead: list[Request] = []  # requests with images whose tower has not been queued yet
        self._text_source = text_source_factory(loaded.tokenizer)
        self.guides = GuideCompiler(loaded.tokenizer, loaded.vocab_size, loaded.eos_token_ids)
        self._num_steps = 0
        self._step_seconds_total = 0.0
        self._step_cpu_seconds_total = 0.0
        self._step_phases = StepPhaseSeconds()
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self._recent_generation: list[tuple[float, int]] = []
        # First tokens of prompts the last step completed (EngineLoop sends those outputs at once).
        self.last_step_first_tokens = 0

    # ---- requests --------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request checked by `limits` (engine clients check at submit; callers of the core do too)."""
        if request.request_id in self._states:
            raise InvalidRequestError(f"Duplicate request id '{request.request_id}'", param="request_id")
        if request.vision is not None and request.vision.pixels_left_out:  # the features it needs are held now
            if self.runner.vision is None:
                raise InvalidRequestError("This model takes no images", param="messages")
            request.held_image_features = self.runner.vision.held_features(request.vision, self.runner.features)
        if request.vision is not None and self.runner.vision is not None:
            request.vision_cost_tokens = vision_cost_tokens(
                self.runner.vision, self.runner.features, request, self._prefill_tokens_per_s)
            if request.held_image_features is None:
                self._towers_ahead.append(request)
        if request.sampling.guided is not None and request.guide is None:
            request.guide = self.guides.compile(request.sampling.guided)  # engine clients compile off-thread first
        if request.adapter is not None:
            adapter = self.adapters.slots.find(request.adapter)
            request.adapter_slot = adapter.slot
            request.prompt_cache_keys = adapter_cache_keys(request.cache_keys, request.prompt_token_ids[0], adapter.uid)
        self.scheduler.add_request(request)
        self._states[request.request_id] = RequestOutputState(
            request, self._text_source, self.loaded.eos_token_ids
        )

    # ---- per-request adapters (engine/adapters/) --------------------------
    def load_adapter(self, name: str, path: Path) -> LoadedAdapter:
        """Load a LoRA adapter that requests then name (Request.adapter); may unload the least recently used one."""
        return self.adapters.load(name, path, in_use=self._adapter_in_use)

    def unload_adapter(self, name: str) -> LoadedAdapter:
        return self.adapters.unload(name)

    def _adapter_in_use(self, slot: int) -> bool:
        return any(state.request.adapter_slot == slot for state in self._states.values())

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; its KV is freed at the next step. None if it is unknown or done."""
        state = self._states.pop(request_id, None)
        if state is None:
            return None
        self.scheduler.finish_request(state.request, RequestStatus.FINISHED_ABORTED)
        return RequestOutput(request_id, finish=state.finish_event(RequestStatus.FINISHED_ABORTED))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self.runner.holds_state()

    # ---- the step --------------------------------------------------------
    def step(
        self,
        before_device_work: Callable[[], None] | None = None,
        on_admitted: Callable[[list[RequestOutput]], None] | None = None,
    ) -> list[RequestOutput]:
        """One step; before_device_work is called once the step's forward is built, before the device runs it.
        on_admitted gets the Admitted outputs of the requests this step takes in, before their prefill runs."""
        started, started_cpu = time.perf_counter(), time.thread_time()
        if self._towers_ahead:
            self._run_towers_ahead()
        if self.scheduler.uncached_prompts_may_be_hit():  # copied before admissions look for hits
            self.runner.cache_prefilled_prompts()
        scheduled = self.scheduler.schedule()
        if on_admitted is not None and any(not new.resumed for new in scheduled.new_requests):
            on_admitted(self._admissions(scheduled))
        outputs = self._expired_outputs(scheduled)
        scheduled_at, waited_before = time.perf_counter(), self.runner.read_wait_seconds
        # The previous step's tokens are taken in on the runner's worker thread while this step's work launches
        # (runner/overlapped_launch.py); the output holds the rest (first tokens, a verifying step's tokens).
        sampled = self.runner.execute(
            scheduled, before_device_work, on_tokens=lambda tokens: outputs.extend(self._update(tokens)))
        ran_at = time.perf_counter()
        self.last_step_first_tokens = sampled.num_first_tokens
        self._note_drafts(sampled)
        outputs += self._update(sampled.sampled)
        self._count(scheduled, outputs)
        self._time_phases(started, scheduled_at, ran_at, self.runner.read_wait_seconds - waited_before)
        self._step_cpu_seconds_total += time.thread_time() - started_cpu
        self._log_if_slow(scheduled, started, scheduled_at, ran_at)
        return outputs

    def _run_towers_ahead(self) -> None:
        """The vision tower of requests that came with images, run before their admission on a stream of its own and
        waited for, so they can be admitted in this very step: MLX's launch of a graph the tower's size returns only
        with at most 10 command buffers of it left in flight (most of it done), so it ran in front of the decode
        steps anyway, and an admission held for its predicted end came by our reckoning ~0.5 s late for a batch of 16
        images on an H200 (docs/architecture.md). At most a step's prefill budget of image tokens, no more than
        the forward allowance holds at what the tower's runs held per token (vision/tower_memory.py), and features
        held ahead for at most max_prefill_seqs waiting requests (a step admits no more): a long queue of images
        holds no more device memory than that."""
        self._towers_ahead = [r for r in self._towers_ahead if r.status == RequestStatus.WAITING]  # not admitted
        budget, taken, tokens = self.config.prefill_token_budget, [], 0
        room = self.config.max_prefill_seqs - sum(1 for r in self.scheduler.waiting if r.held_image_features)
        memory = self.runner.vision.tower_memory  # only a VLM takes requests with images (add_request)
        # Less where MLX's limit has come down since load: another process took part of the card.
        allowance = min(self.forward_allowance_bytes, headroom_bytes())
        while self._towers_ahead and len(taken) < room:
            request = self._towers_ahead[0]
            more = tokens + request.num_media_tokens
            if taken and ((budget is not None and more > budget) or not memory.fits(more, allowance)):
                break
            self._towers_ahead.pop(0)
            if not self.scheduler.kv.holds_media(request):  # else its images' KV is cached: it needs no tower
                tokens = more
                taken.append(request)
        self.runner.run_towers_ahead(taken)

    def _log_if_slow(self, scheduled: SchedulerOutput, started: float, scheduled_at: float, ran_at: float) -> None:
        """A step past slow_step_log_seconds (and several expected steps; 0: every step) goes to the log with what it
        held and what MLX holds against its limit: a stall's trace (a kernel built for a new shape, a prefix-cache
        copy, memory pressure) without a profiler. Its schedule phase holds the towers run ahead."""
        seconds, bound = time.perf_counter() - started, self.config.slow_step_log_seconds
        if bound and seconds < max(bound, 8 * (self.expected_step_s or 0.0)):
            return
        logger.warning(
            "slow step %d: %.3f s (schedule %.3f, run %.3f, output %.3f): %d decode rows, %d new requests (%d with "
            "images), %d prefill chunks of %d tokens; %s", self._num_steps, seconds, scheduled_at - started,
            ran_at - scheduled_at, started + seconds - ran_at, len(scheduled.decode_rows), len(scheduled.new_requests),
            sum(1 for new in scheduled.new_requests if new.vision is not None), len(scheduled.prefill_chunks),
            scheduled.num_prefill_tokens, memory_reading().describe())

    def _time_phases(self, started: float, scheduled_at: float, ran_at: float, waited: float) -> None:
        ended = time.perf_counter()
        phases = self._step_phases
        phases.schedule += scheduled_at - started
        phases.build += ran_at - scheduled_at - waited
        phases.wait += waited
        phases.output += ended - ran_at
        self._step_seconds_total += ended - started

    def _update(self, tokens: list[SampledToken]) -> list[RequestOutput]:
        """Each token's output, in order; a request that finishes leaves the scheduler (pure Python: this runs on the
        runner's worker thread during a launch, while the engine thread is inside MLX)."""
        outputs = []
        for token in tokens:
            state = self._states.get(token.request_id)
            if state is None:  # finished or aborted after this token was dispatched
                continue
            verdict = state.on_token(token)
            outputs.append(verdict.output)
            if verdict.finished_status is not None:
                self.scheduler.finish_request(state.request, verdict.finished_status)
                del self._states[token.request_id]
        return outputs

    def _note_drafts(self, result: RunnerOutput) -> None:
        """Verified drafts: the scheduler counts the accepted ones as computed; usage reports them."""
        if not result.drafted:
            return
        self.scheduler.accept_drafts(result.accepted_drafts)
        for request_id, drafted in result.drafted.items():
            state = self._states.get(request_id)
            if state is not None:
                state.request.num_drafted_tokens += drafted
                state.request.num_accepted_draft_tokens += result.accepted_drafts.get(request_id, 0)

    def _admissions(self, scheduled: SchedulerOutput) -> list[RequestOutput]:
        """The requests taken in this step, with their prompt's prefix-cache hit (matched by the scheduler)."""
        # A resumed request was announced at its first admission.
        states = [self._states[new.request_id] for new in scheduled.new_requests if not new.resumed]
        return [RequestOutput(state.request.request_id, admitted=state.admitted()) for state in states]

    def _expired_outputs(self, scheduled: SchedulerOutput) -> list[RequestOutput]:
        outputs = []
        for expired in scheduled.expired:
            self._states.pop(expired.request_id, None)
            outputs.append(RequestOutput(expired.request_id, error=expired.error))
        return outputs

    # ---- stats -----------------------------------------------------------
    def _count(self, scheduled: SchedulerOutput, outputs: list[RequestOutput]) -> None:
        self._num_steps += 1
        self._prompt_tokens_total += scheduled.num_prefill_tokens
        generated = sum(len(o.new_token_ids) for o in outputs)
        self._generation_tokens_total += generated
        now = time.monotonic()
        self._recent_generation.append((now, generated))
        while self._recent_generation and now - self._recent_generation[0][0] > THROUGHPUT_WINDOW_S:
            self._recent_generation.pop(0)

    def stats(self) -> EngineStats:
        recent = self._recent_generation
        span = recent[-1][0] - recent[0][0] if len(recent) > 1 else 0.0
        rate = sum(n for _, n in recent[1:]) / span if span > 0 else 0.0
        return EngineStats(
            num_waiting=self.scheduler.num_waiting,
            num_running=self.scheduler.num_running,
            num_decoding=self.runner.batch.num_live_rows,
            max_num_seqs=self.config.max_num_seqs,
            queue_size=self.config.queue_size,
            kv_cache_bytes=self.runner.kv_cache_bytes(),
            num_steps=self._num_steps,
            step_seconds_total=self._step_seconds_total,
            step_cpu_seconds_total=self._step_cpu_seconds_total,
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
            generation_tokens_per_s=rate,
            process_cpu_seconds=time.process_time(),
            memory=read_engine_memory(),
            prefix_cache=replace(self.runner.prefix_cache.stats) if self.runner.prefix_cache else None,
            expected_step_s=self.expected_step_s,
            speculation=self.runner.speculation_stats(),
            guide_compiles=self.guides.stats(),
            step_phases=replace(self._step_phases),
            kv_budget_bytes=self.kv_budget.budget_bytes,
            kv_bytes_per_token=self.kv_budget.bytes_per_token,
            kv_planned_bytes=self.scheduler.kv_planned_bytes,
            num_preemptions=self.scheduler.num_preemptions,
            num_preempted=self.scheduler.num_preempted,
            vision_features=self.runner.features.stats() if self.runner.features is not None else None,
            vision_tower=replace(self.runner.vision.tower_stats) if self.runner.vision is not None else None,
        )

    def release_idle_buffers(self) -> None:
        """Return MLX's buffer cache to the device if no request is in the engine (call when idle)."""
        if not self.has_unfinished_requests():
            self.runner.release_buffers()

    def close(self) -> None:
        self.runner.close()


def _kv_budget(loaded: LoadedModel, config: EngineConfig, prefix_cache: PrefixCache | None, draft: LoadedModel | None) -> KVBudget:
    """The running requests' KV budget, reported at load: config.kv_budget_bytes, else kv_memory_fraction of the
    device's memory less what MLX holds now (weights, other models) and the prefix cache's budget."""
    per_token = kv_bytes_per_token(loaded.model, config.kv_quantization) + (
        kv_bytes_per_token(draft.model) if draft is not None else 0)
    budget = config.kv_budget_bytes
    if budget is None:
        budget = default_kv_budget_bytes(config.kv_memory_fraction, _held_budgets_bytes(loaded, config, prefix_cache))
    drafts = config.speculative.num_draft_tokens if config.speculative is not None else 0
    kv_budget = KVBudget(budget, per_token, KV_ALLOCATION_STEP + drafts)
    logger.info(
        "KV budget of %s: %d bytes, %d bytes per token: at most %d tokens for one request",
        loaded.path.name, budget, per_token, kv_budget.max_request_tokens,
    )
    return kv_budget


def _held_budgets_bytes(loaded: LoadedModel, config: EngineConfig, prefix_cache: PrefixCache | None) -> int:
    """What the engine keeps beside the running requests' KV, at most: the prefix cache and a VLM's kept features."""
    kept = vision_features_budget(config) if isinstance(loaded.model, VisionLanguageModel) else 0
    return (prefix_cache.capacity_bytes if prefix_cache else 0) + kept
