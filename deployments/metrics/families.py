"""Every metric Orchard exports, in one table: name, kind, help, labels (besides `model_name`), buckets.

Names are vLLM's where they mean the same thing (`vllm:` becomes `orchard:`), so dashboards written for vLLM read
them; Ray's metrics API takes no `:`, so there the prefix is `orchard_` (and Ray's exporter adds `ray_`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

PREFIX = "orchard:"
RAY_PREFIX = "orchard_"
MODEL_LABEL = "model_name"


class MetricKind(str, Enum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


@dataclass(frozen=True)
class MetricSpec:
    name: str  # without the prefix; a counter's ends in _total
    kind: MetricKind
    help: str
    labels: tuple[str, ...] = ()  # besides model_name
    buckets: tuple[float, ...] = ()  # a histogram's upper bounds (+Inf is implied)

    @property
    def full_name(self) -> str:
        return PREFIX + self.name

    @property
    def ray_name(self) -> str:
        return RAY_PREFIX + self.name


# vLLM's buckets, with finer low ones: MLX decodes a step in milliseconds.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

COUNTER, GAUGE, HISTOGRAM = MetricKind.COUNTER, MetricKind.GAUGE, MetricKind.HISTOGRAM

# ---- the ingress: one per HTTP request that reached a model ---------------------------------------------
REQUESTS = MetricSpec(
    "requests_total", COUNTER, "Requests by API and how they ended (finished, aborted, error).", ("api", "status")
)

# ---- the model replica: one per request ------------------------------------------------------------------
REQUEST_SUCCESS = MetricSpec(
    "request_success_total", COUNTER, "Requests the engine ended, by finish reason.", ("finished_reason",)
)
PROMPT_TOKENS = MetricSpec("prompt_tokens_total", COUNTER, "Prompt tokens of ended requests (cached ones included).")
GENERATION_TOKENS = MetricSpec("generation_tokens_total", COUNTER, "Generated tokens of ended requests.")
TTFT = MetricSpec(
    "time_to_first_token_seconds", HISTOGRAM, "From the model's receipt of a request to its first token.",
    buckets=_TTFT_BUCKETS,
)
ITL = MetricSpec(
    "inter_token_latency_seconds", HISTOGRAM,
    "Between a request's tokens (tokens that arrive together share the wait evenly).", buckets=_ITL_BUCKETS,
)
E2E = MetricSpec(
    "e2e_request_latency_seconds", HISTOGRAM, "From the model's receipt of a request to its end.",
    buckets=_REQUEST_BUCKETS,
)
QUEUE_TIME = MetricSpec(
    "request_queue_time_seconds", HISTOGRAM, "From the engine's acceptance of a request to its admission.",
    buckets=_REQUEST_BUCKETS,
)

# ---- the model replica: read from the engine's stats when scraped ---------------------------------------
RUNNING = MetricSpec("num_requests_running", GAUGE, "Requests in the engine's batch.")
WAITING = MetricSpec("num_requests_waiting", GAUGE, "Requests waiting for a slot in the batch.")
KV_CACHE_BYTES = MetricSpec("kv_cache_bytes", GAUGE, "Bytes of KV cache the running requests hold.")
KV_BUDGET_BYTES = MetricSpec(
    "kv_cache_budget_bytes", GAUGE, "The running requests' KV budget: past it the newest are preempted."
)
PREEMPTIONS = MetricSpec("num_preemptions_total", COUNTER, "Requests preempted for KV (each resumes by recompute).")
PREEMPTED = MetricSpec(
    "num_requests_preempted", GAUGE, "Preempted requests waiting to resume (num_requests_waiting counts them too)."
)
PREFIX_LOOKUPS = MetricSpec(
    "prefix_cache_lookups_total", COUNTER, "Prefix-cache lookups by result (hit, miss).", ("result",)
)
PREFIX_HIT_TOKENS = MetricSpec("prefix_cache_hit_tokens_total", COUNTER, "Prompt tokens read from the prefix cache.")
PREFIX_CACHE_BYTES = MetricSpec("prefix_cache_bytes", GAUGE, "Bytes the prefix cache holds.")
VISION_LOOKUPS = MetricSpec(
    "vision_feature_cache_lookups_total", COUNTER,
    "Prompts with images by whether every image's vision features were kept (hit) or the tower ran (miss).",
    ("result",),
)
VISION_CACHE_BYTES = MetricSpec("vision_feature_cache_bytes", GAUGE, "Bytes of vision features kept across requests.")
VISION_TOWER_IMAGES = MetricSpec("vision_tower_images_total", COUNTER, "Images run through the batched vision tower.")
VISION_TOWER_SECONDS = MetricSpec("vision_tower_seconds_total", COUNTER,
                                  "Seconds of the batched vision tower's forwards (device time the images took; "
                                  "the first runs timed, later ones at their rate).")
SPEC_VERIFY_STEPS = MetricSpec("spec_decode_verify_steps_total", COUNTER, "Engine steps that verified draft tokens.")
SPEC_DRAFT_TOKENS = MetricSpec("spec_decode_num_draft_tokens_total", COUNTER, "Draft tokens proposed.")
SPEC_ACCEPTED_TOKENS = MetricSpec("spec_decode_num_accepted_tokens_total", COUNTER, "Draft tokens accepted.")
GUIDE_COMPILES = MetricSpec(
    "structured_output_compiles_total", COUNTER, "Structured-output guides compiled (cache misses)."
)
GUIDE_COMPILE_SECONDS = MetricSpec(
    "structured_output_compile_seconds_total", COUNTER,
    "Seconds spent compiling structured-output guides (their mean: divide the rates).",
)
ENGINE_RESTARTS = MetricSpec("engine_restarts_total", COUNTER, "Times the model's engine died and was restarted.")
MEMORY_BYTES = MetricSpec(
    "memory_bytes", GAUGE,
    "The model's memory: MLX's allocator (mlx_active, mlx_cache, mlx_peak) and resident set (rss).", ("kind",),
)

MODEL_LOADS = MetricSpec(
    "model_loads_total", COUNTER, "Loads of the model counted against the node's memory budget (memory.budget_bytes).")
MODEL_EVICTIONS = MetricSpec(
    "model_evictions_total", COUNTER, "Times the model was unloaded to make room under the memory budget, or when idle.")
RESIDENT_BYTES = MetricSpec(
    "model_resident_bytes", GAUGE, "The model's footprint counted against the memory budget (loading ones too).")

ALL_SPECS = (
    REQUESTS, REQUEST_SUCCESS, PROMPT_TOKENS, GENERATION_TOKENS, TTFT, ITL, E2E, QUEUE_TIME, RUNNING, WAITING,
    KV_CACHE_BYTES, KV_BUDGET_BYTES, PREEMPTIONS, PREEMPTED, PREFIX_LOOKUPS, PREFIX_HIT_TOKENS, PREFIX_CACHE_BYTES, VISION_LOOKUPS,
    VISION_CACHE_BYTES, VISION_TOWER_IMAGES, VISION_TOWER_SECONDS, SPEC_VERIFY_STEPS, SPEC_DRAFT_TOKENS,
    SPEC_ACCEPTED_TOKENS, GUIDE_COMPILES, GUIDE_COMPILE_SECONDS, ENGINE_RESTARTS, MEMORY_BYTES, MODEL_LOADS,
    MODEL_EVICTIONS, RESIDENT_BYTES,
)
