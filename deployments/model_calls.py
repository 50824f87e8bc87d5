"""What crosses between the ingress and a model (a Ray handle or an in-process call): plain dataclasses.

The ingress sends a GenerateJob; the model answers with StreamChunks, each the coalesced
output of one or more engine steps (a Ray handle stream carries only ~2,000 items/s).
A contract module: the ingress's side (ingress/, api/, transport/) and the model's (model/, chat/, embeddings/)
import it; it imports nothing of either.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Literal, Protocol

from engine.health import EngineHealth, EngineStatus
from engine.errors import OrchardError
from engine.output.request_output import Finish
from engine.request import Priority
from deployments.output_deltas import McpEvent, ToolCallDelta
from engine.sampling.params import SamplingParams
from engine.spec_decode.speculator import SpeculationStats

ToolChoiceMode = Literal["auto", "none", "required", "function"]


@dataclass
class ImageInput:
    """One image of a chat prompt as the client sent it; the model side decodes and checks it (off the event loop).

    `data` holds the encoded file (PNG, JPEG, WebP, GIF, ...); the ingress fills it from a data URL or base64
    block, or by fetching `url` where the operator allows remote media (then `url` is kept for logs only).
    """

    data: bytes
    param: str  # where it sits in the request, for errors: "messages.0.content.1"
    media_type: str | None = None  # as declared by the client (a data URL's or Anthropic's media_type)
    detail: Literal["auto", "low", "high"] | None = None  # OpenAI's image_url.detail
    url: str | None = None  # the remote URL it was fetched from, if any


@dataclass
class VideoInput:
    """One video of a chat prompt: an encoded file (`data`, sampled on the model side at the processor's rate) or
    its frames as images, in order (`frames`)."""

    param: str
    data: bytes = b""
    media_type: str | None = None
    frames: list[ImageInput] = field(default_factory=list)


@dataclass
class ChatPrompt:
    """Messages rendered by the model's chat template (content flattened to text, except images).

    A message with images has list content: `{"type": "text", "text": ...}` and `{"type": "image"}` parts
    (the Hugging Face chat-template convention); `images` holds those images' data, in the order the
    placeholders appear across all messages; `videos` likewise for `{"type": "video"}` parts.

    `tools` are OpenAI-style function definitions. tool_choice "required" / "function" (naming
    `tool_name`) makes the model side constrain the output to one call in the model's markup.
    """

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    tool_choice: ToolChoiceMode = "auto"
    tool_name: str | None = None
    parallel_tool_calls: bool = True
    images: list[ImageInput] = field(default_factory=list)
    videos: list[VideoInput] = field(default_factory=list)


@dataclass
class TextPrompt:
    """A raw completion prompt: text to tokenize, or token ids as they are."""

    text: str | None = None
    token_ids: list[int] | None = None


@dataclass
class GenerateJob:
    request_id: str  # unique per request (the completion id); the engine's request id
    prompt: ChatPrompt | TextPrompt
    sampling: SamplingParams
    stream: bool  # False: the model sends one chunk at the end instead of time-coalesced ones
    log_id: str = ""  # the HTTP X-Request-Id, for log lines
    # Anthropic's max_tokens is a ceiling (Claude Code asks for 32,000 whatever the model): the model
    # side lowers it to the room the context leaves instead of refusing the request.
    clamp_max_tokens: bool = False
    # False: the request never speculates (the request field `speculative`), on a model that does.
    speculative: bool = True
    # The per-request LoRA adapter the request's model ('MODEL:NAME') names (None: the base model).
    adapter: "AdapterRef | None" = None
    # The engine's scheduling class: the X-Orchard-Priority header's (batch lines: ingress/batch_routes.py).
    priority: Priority = Priority.INTERACTIVE


@dataclass(frozen=True)
class AdapterRef:
    """A per-request adapter: its name on the model and its folder (checked where it was registered), so that any
    replica can load it."""

    name: str
    path: str


@dataclass
class AdapterListing:
    """A model replica's per-request adapters: registered (name -> folder) and loaded in its engine now; or why an
    adapter call failed (nothing changed then)."""

    registered: dict[str, str] = field(default_factory=dict)
    loaded: list[str] = field(default_factory=list)
    error: OrchardError | None = None


@dataclass
class TopTokenLogprob:
    token: str
    token_bytes: list[int]
    logprob: float


@dataclass
class TokenLogprobInfo:
    """One generated token with its text, for OpenAI's logprobs objects."""

    token: str
    token_bytes: list[int]
    logprob: float
    top_logprobs: list[TopTokenLogprob] = field(default_factory=list)


@dataclass
class StreamChunk:
    """Output since the previous chunk; the last chunk has `finish` or `error`.

    `text` is the content (all the text when the model has no output parser), `reasoning` the
    reasoning text and `tool_calls` the tool-call deltas the model side parsed out of the output.
    Within a chunk they come in that order, then `mcp`: what the ingress's MCP tool loop did (its listings, calls
    and their results), after the model turn whose calls it ran. The first chunk carries the prompt's token count. A streamed
    job's first chunk is `queued` (the engine accepted the request: refusals are behind it; the ingress opens the
    HTTP stream with it); a later one is `admitted` (taken into the batch, its prefill starts) and carries
    `cached_tokens`: the API's opening event goes out with it, usually before any output.
    """

    text: str = ""
    num_tokens: int = 0
    logprobs: list[TokenLogprobInfo] | None = None
    finish: Finish | None = None
    error: OrchardError | None = None
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    prompt_tokens: int | None = None
    queued: bool = False  # the engine accepted the request (it may still wait for a slot)
    admitted: bool = False
    cached_tokens: int | None = None  # of prompt_tokens, from the prefix cache (told with the admission)
    mcp: list[McpEvent] = field(default_factory=list)
    tool_loop_paused: bool = False  # the last chunk: the MCP tool loop stopped at its bound of rounds

    @property
    def is_last(self) -> bool:
        return self.finish is not None or self.error is not None

    @property
    def is_admission_only(self) -> bool:
        """Queued or admitted, with no output yet: sent at once, and no coalescing window starts with it."""
        return (self.queued or self.admitted) and not (
            self.num_tokens or self.text or self.reasoning or self.tool_calls or self.mcp or self.is_last)

    def merge(self, later: "StreamChunk") -> None:
        self.text += later.text
        self.reasoning += later.reasoning
        for delta in later.tool_calls:
            last = self.tool_calls[-1] if self.tool_calls else None
            if last is not None and last.index == delta.index:
                self.tool_calls[-1] = last.joined(delta)
            else:
                self.tool_calls.append(delta)
        self.mcp += later.mcp
        self.num_tokens += later.num_tokens
        if later.logprobs is not None:
            self.logprobs = (self.logprobs or []) + later.logprobs
        if self.prompt_tokens is None:
            self.prompt_tokens = later.prompt_tokens
        if self.cached_tokens is None:
            self.cached_tokens = later.cached_tokens
        self.queued = self.queued or later.queued
        self.admitted = self.admitted or later.admitted
        self.tool_loop_paused = self.tool_loop_paused or later.tool_loop_paused
        self.finish = later.finish or self.finish
        self.error = later.error or self.error


def merged(parts: list[StreamChunk]) -> StreamChunk:
    """An answer's chunks as one (a new chunk: the parts are left as they are)."""
    total = StreamChunk()
    for part in parts:
        total.merge(part)
    return total


@dataclass
class TokenCount:
    """A prompt's token count, or why it could not be rendered (errors travel as values over Ray)."""

    input_tokens: int = 0
    error: OrchardError | None = None


@dataclass
class EmbedJob:
    """Inputs of one /v1/embeddings request: texts, or token ids (decoded by the model's tokenizer)."""

    inputs: list[str] | list[list[int]]
    # Over the model's max_seq_length: refused naming the input (False) or cut to it (True).
    truncate: bool = False
    dimensions: int | None = None  # keep the first n components, renormalised
    log_id: str = ""


@dataclass
class EmbedResult:
    """One unit-length float32 vector per input (little-endian bytes: numpy-free across Ray and JSON-ready),
    the tokens the model read, or why the job was refused (errors travel as values over Ray)."""

    vectors: list[bytes] = field(default_factory=list)
    dimension: int = 0
    prompt_tokens: int = 0
    error: OrchardError | None = None


@dataclass
class TextTokensJob:
    """Texts whose tokens an embedding model counts (special tokens left out): how RAG measures its chunks."""

    texts: list[str]
    log_id: str = ""


@dataclass
class TextTokenCounts:
    counts: list[int] = field(default_factory=list)
    error: OrchardError | None = None


@dataclass
class MemoryUsage:
    """MiB. mlx_* are MLX's allocator counters (Metal/CUDA memory, or part of RSS on the CPU backend)."""

    mlx_active_mb: float
    mlx_cache_mb: float
    mlx_peak_mb: float
    rss_mb: float
    total_mb: float


@dataclass
class ModelInfo:
    model_id: str
    model_type: str
    model_path: str
    context_length: int
    created_at: int
    pid: int
    memory: MemoryUsage
    # The engine's state (running, degraded, restarting, failed) and how often it was restarted.
    health: EngineHealth = field(default_factory=lambda: EngineHealth(EngineStatus.RUNNING))
    engine_pid: int | None = None  # where the engine steps in a process of its own
    engine_restarts: int = 0
    # Ray's node of the replica that answered, when it is the model's only one: an ingress on that node can tell
    # at once that its process died (Serve notices at its next health check, up to 10 s later).
    sole_replica_node: str | None = None
    # Its per-request LoRA adapters (a text model's): registered on the replica that answered, and loaded there.
    adapters: AdapterListing = field(default_factory=AdapterListing)


@dataclass
class QueueStats:
    model_id: str
    waiting: int
    running: int
    decoding: int
    max_num_seqs: int
    queue_size: int | None
    kv_cache_bytes: int
    prompt_tokens_total: int
    generation_tokens_total: int
    tokens_per_s: float
    # Engine steps, their wall and engine-thread CPU seconds, and the model process's CPU seconds
    # (all threads): deltas between two reads show where a step's time goes under load.
    steps_total: int
    step_seconds_total: float
    step_cpu_seconds_total: float
    process_cpu_seconds_total: float
    # Streams the ingress received over the replica's stream channel (None: the model has none).
    channel_streams_total: int | None = None
    # A vision-language model's batched tower: images run and seconds taken (None: no such tower).
    vision_tower_images_total: int | None = None
    vision_tower_seconds_total: float | None = None
    # Speculative decoding's counts since the engine started (None: the model does not speculate).
    speculation: SpeculationStats | None = None
    # A model with several replicas: each one's own (the fields above are their sums); None: one replica answered.
    replicas: "list[ReplicaQueueStats] | None" = None


@dataclass
class ReplicaQueueStats:
    """One replica of a model with several, as it last reported (transport/replica_board.py)."""

    replica_id: str
    node_id: str
    pid: int
    age_s: float  # since that report (they come every second)
    health: EngineHealth | None
    stats: QueueStats


@dataclass
class Sample:
    """A counter's or gauge's value for one set of labels (model_name included)."""

    name: str  # the spec's name (metrics/families.py), without the prefix
    labels: dict[str, str]
    value: float


@dataclass
class HistogramSample:
    name: str
    labels: dict[str, str]
    bucket_counts: list[int]  # per bucket of the spec, then +Inf; not cumulative
    sum: float = 0.0

    @property
    def count(self) -> int:
        return sum(self.bucket_counts)


@dataclass
class MetricsSnapshot:
    """A process's metric values at one moment (metrics/recorder.py): what a model replica hands the ingress for its
    /metrics."""

    samples: list[Sample] = field(default_factory=list)
    histograms: list[HistogramSample] = field(default_factory=list)


class ModelClient(Protocol):
    """How the ingress talks to one model, wherever it runs."""

    def generate(self, job: GenerateJob) -> AsyncIterator[StreamChunk]: ...

    async def count_tokens(self, prompt: ChatPrompt) -> TokenCount: ...

    async def embed(self, job: EmbedJob) -> EmbedResult: ...

    async def count_text_tokens(self, job: TextTokensJob) -> TextTokenCounts: ...

    def transcribe(self, job: Any) -> AsyncIterator[Any]:
        """A speech-to-text model's TranscriptEvents for a TranscribeJob (speech_calls.py)."""

    def speak(self, job: Any) -> AsyncIterator[Any]:
        """A text-to-speech model's SpeechAudioEvents for a SpeakJob (speech_calls.py)."""

    def generate_images(self, job: Any) -> AsyncIterator[Any]:
        """An image model's ImageEvents for an ImageJob (image_calls.py)."""

    async def info(self) -> ModelInfo: ...

    async def queue_stats(self) -> QueueStats: ...

    async def metrics(self) -> MetricsSnapshot: ...

    async def load_adapter(self, name: str, path: str) -> AdapterListing:
        """Register a per-request adapter and load it (on one replica: others load it when a request names it)."""

    async def unload_adapter(self, name: str) -> AdapterListing: ...
