"""One streamed OpenAI request, timed per network read (aiohttp only: the GPU image has no openai client).

Random-weight benchmark models use a WordLevel tokenizer where word "tN" is token N and the
output is space-joined words, so a K-token prompt is K random words and the tokens in a
stream chunk are counted as its words. When the server reports `usage` (stream_options),
the per-chunk counts are rescaled so that they sum to usage.completion_tokens.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import aiohttp
import numpy as np

# The top ids of our random models hold the special tokens: prompts use plain words only.
RESERVED_TOP_IDS = 16


@dataclass
class Target:
    """A server under test: where it is, how to address the model, and what extra fields it accepts."""

    base_url: str
    model: str
    name: str = "server"
    endpoint: str = "chat"  # "chat" (/v1/chat/completions) or "completions" (/v1/completions)
    extra_body: dict[str, Any] = field(default_factory=dict)  # e.g. {"ignore_eos": True} for ours
    headers: dict[str, str] = field(default_factory=dict)  # e.g. Authorization for a server with API keys


@dataclass
class EngineCounters:
    """One read of our server's engine counters (cumulative since the model started)."""

    at: float
    steps: int
    step_s: float
    step_cpu_s: float
    process_cpu_s: float
    # A model with several replicas: each one's generated tokens so far (replica id -> count).
    replica_tokens: dict[str, int] = field(default_factory=dict)
    # A vision-language model's batched tower: images and seconds so far.
    tower_images: int = 0
    tower_s: float = 0.0


@dataclass
class RequestSpec:
    prompt: str
    prompt_words: int
    max_tokens: int
    image_url: Optional[str] = None  # a data URL: sent as an OpenAI image_url part before the text (chat only)


@dataclass
class Arrival:  # one network read that carried generated text
    at: float
    tokens: float  # words in the read, rescaled to the server's usage count when it gives one


@dataclass
class RequestRecord:
    """What one request observed; times are time.perf_counter() seconds."""

    sent_at: float
    prompt_words: int
    max_tokens: int
    arrivals: list[Arrival] = field(default_factory=list)
    end_at: float = 0.0
    completion_tokens: float = 0.0
    usage_prompt_tokens: Optional[int] = None
    cached_tokens: Optional[int] = None
    error: Optional[str] = None
    cancelled: bool = False  # the benchmark closed it on purpose (not an error)
    images: int = 0  # images the request carried
    connect_s: Optional[float] = None  # new TCP connection's set-up time (seconds at 1 s+: a full listen backlog)

    @property
    def first_token_at(self) -> Optional[float]:
        return self.arrivals[0].at if self.arrivals else None

    @property
    def ttft_s(self) -> Optional[float]:
        first = self.first_token_at
        return None if first is None else first - self.sent_at

    @property
    def ok(self) -> bool:
        return self.error is None and not self.cancelled

    def tokens_so_far(self) -> float:
        return sum(a.tokens for a in self.arrivals)


# ---- prompts
def random_words(rng: np.random.Generator, num_words: int, vocab_size: int) -> str:
    ids = rng.integers(0, max(vocab_size - RESERVED_TOP_IDS, 2), size=num_words)
    return " ".join(f"t{i}" for i in ids)


def make_spec(rng: np.random.Generator, num_words: int, max_tokens: int, vocab_size: int) -> RequestSpec:
    return RequestSpec(random_words(rng, num_words, vocab_size), num_words, max_tokens)


def request_body(target: Target, spec: RequestSpec) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {
        "model": target.model,
        "max_tokens": spec.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if target.endpoint == "chat":
        content: Any = spec.prompt
        if spec.image_url is not None:
            content = [{"type": "image_url", "image_url": {"url": spec.image_url}}, {"type": "text", "text": spec.prompt}]
        body["messages"] = [{"role": "user", "content": content}]
        path = "/v1/chat/completions"
    elif spec.image_url is not None:
        raise ValueError("images need the chat endpoint")
    else:
        body["prompt"] = spec.prompt
        path = "/v1/completions"
    body.update(target.extra_body)
    return target.base_url.rstrip("/") + path, body


# ---- SSE parsing
@dataclass
class EventInfo:
    text: str = ""
    usage: Optional[dict[str, Any]] = None
    error: Optional[str] = None
    done: bool = False


def parse_event(data: bytes) -> EventInfo:
    """One `data:` payload of an OpenAI stream (chat or completions)."""
    if data.strip() == b"[DONE]":
        return EventInfo(done=True)
    payload = json.loads(data)
    if "error" in payload and payload["error"]:
        err = payload["error"]
        return EventInfo(error=str(err.get("message", err) if isinstance(err, dict) else err))
    text = ""
    for choice in payload.get("choices") or []:
        delta = choice.get("delta")
        if delta is not None:  # chat: content (and any reasoning text) counts as generated tokens
            text += (delta.get("content") or "") + (delta.get("reasoning_content") or delta.get("reasoning") or "")
        else:
            text += choice.get("text") or ""
    return EventInfo(text=text, usage=payload.get("usage"))


class SSEReader:
    """Splits a byte stream into `data:` payloads; comments (`: keepalive`) and blank lines are skipped."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, data: bytes) -> list[bytes]:
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        return [line[5:].strip() for line in lines if line.startswith(b"data:")]


# ---- one request
class StreamClient:
    """Shared aiohttp session; `stream(spec)` returns a RequestRecord and never raises (errors are recorded)."""

    def __init__(self, target: Target, request_timeout_s: float = 600.0) -> None:
        self.target = target
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_s, sock_connect=30)
        self._session: Optional[aiohttp.ClientSession] = None

    async def __aenter__(self) -> "StreamClient":
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=None)
        self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout, headers=self.target.headers,
                                              trace_configs=[_connect_timer()])
        return self

    async def __aexit__(self, *exc: Any) -> None:
        assert self._session is not None
        await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        """The open session, for calls other than streams (the batch workload's files and batches)."""
        assert self._session is not None
        return self._session

    async def engine_counters(self) -> Optional[EngineCounters]:
        """Our server's engine counters for the target model (/v1/queue/stats); None from other servers."""
        assert self._session is not None
        try:
            async with self._session.get(self.target.base_url + "/v1/queue/stats") as resp:
                rows = (await resp.json())["models"] if resp.status == 200 else []
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError, KeyError, TypeError):
            return None
        row = next((r for r in rows if isinstance(r, dict) and r.get("id") == self.target.model), None)
        if row is None or row.get("engine_steps_total") is None:
            return None
        replicas = {r["replica_id"]: r["generation_tokens_total"] for r in row.get("replicas") or []}
        return EngineCounters(time.perf_counter(), row["engine_steps_total"], row["engine_step_seconds_total"],
                              row["engine_step_cpu_seconds_total"], row["process_cpu_seconds_total"], replicas,
                              row.get("vision_tower_images_total") or 0, row.get("vision_tower_seconds_total") or 0.0)

    async def stream(self, spec: RequestSpec, record: Optional[RequestRecord] = None) -> RequestRecord:
        """Stream one request; pass `record` to watch it fill in while it runs (the long-prompt workload)."""
        assert self._session is not None
        url, body = request_body(self.target, spec)
        if record is None:
            record = RequestRecord(time.perf_counter(), spec.prompt_words, spec.max_tokens)
        record.images = int(spec.image_url is not None)
        record.sent_at = time.perf_counter()
        try:
            await self._consume(url, body, record)
        except asyncio.CancelledError:
            record.cancelled = True
            raise
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
            record.error = f"{type(exc).__name__}: {exc}"[:300]
        finally:
            record.end_at = time.perf_counter()
            _rescale_to_usage(record)
        return record

    async def _consume(self, url: str, body: dict[str, Any], record: RequestRecord) -> None:
        assert self._session is not None
        async with self._session.post(url, json=body, trace_request_ctx=record) as resp:
            if resp.status != 200:
                text = (await resp.text())[:300]
                record.error = f"HTTP {resp.status}: {text}"
                return
            reader, done = SSEReader(), False
            async for data in resp.content.iter_any():
                now = time.perf_counter()
                words = 0
                for payload in reader.feed(data):
                    event = parse_event(payload)
                    if event.error:
                        record.error = f"stream error: {event.error}"[:300]
                    done = done or event.done
                    words += len(event.text.split())
                    _note_usage(record, event.usage)
                if words:
                    record.arrivals.append(Arrival(now, float(words)))
            if not done and record.error is None:
                record.error = "stream ended without [DONE]"


def _connect_timer() -> aiohttp.TraceConfig:
    """Times new connections: a server whose listen backlog overflows shows up as 1 s, 3 s, ... connects."""

    async def start(_session: Any, ctx: Any, _params: Any) -> None:
        ctx.connect_started = time.perf_counter()

    async def end(_session: Any, ctx: Any, _params: Any) -> None:
        record = ctx.trace_request_ctx
        if isinstance(record, RequestRecord):
            record.connect_s = time.perf_counter() - ctx.connect_started

    trace = aiohttp.TraceConfig()
    trace.on_connection_create_start.append(start)
    trace.on_connection_create_end.append(end)
    return trace


def _note_usage(record: RequestRecord, usage: Optional[dict[str, Any]]) -> None:
    if not usage:
        return
    record.completion_tokens = float(usage.get("completion_tokens") or 0)
    record.usage_prompt_tokens = usage.get("prompt_tokens")
    details = usage.get("prompt_tokens_details") or {}
    record.cached_tokens = details.get("cached_tokens")


def _rescale_to_usage(record: RequestRecord) -> None:
    """Word counts stand in for tokens; where usage gives the true count, scale the chunks to it."""
    words = record.tokens_so_far()
    if record.completion_tokens > 0 and words > 0 and abs(words - record.completion_tokens) > 1e-6:
        scale = record.completion_tokens / words
        for arrival in record.arrivals:
            arrival.tokens *= scale
    elif record.completion_tokens <= 0:
        record.completion_tokens = words
