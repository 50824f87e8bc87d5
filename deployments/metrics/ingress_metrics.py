"""The ingress's metrics: requests by API and how they ended, per model (a model's own process measures the rest)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from enum import Enum

from deployments.metrics import families
from deployments.metrics.recorder import MetricsRecorder
from deployments.model_calls import MetricsSnapshot, StreamChunk
from engine.request import FinishReason


class RequestOutcome(str, Enum):
    FINISHED = "finished"  # the model ended it (stop, length)
    ABORTED = "aborted"  # the client went away, or the request was cancelled
    ERROR = "error"  # refused or failed, before or after its first byte


class Api(str, Enum):
    CHAT = "chat"
    COMPLETIONS = "completions"
    MESSAGES = "messages"
    RESPONSES = "responses"
    EMBEDDINGS = "embeddings"
    RAG = "rag"  # /v1/rag/query's answers (retrieval-only queries reach no model)
    AUDIO = "audio"  # /v1/audio/transcriptions and /translations
    SPEECH = "speech"  # /v1/audio/speech
    IMAGES = "images"  # /v1/images/generations and /edits


@dataclass
class RequestTally:
    """Counts one request once, when its outcome is known (a stream's can be known only when it closes)."""

    api: Api
    recorder: MetricsRecorder | None  # None: not counted (RAG's answers)
    ended: bool = False

    def end(self, outcome: RequestOutcome) -> None:
        if self.ended:
            return
        self.ended = True
        if self.recorder is not None:
            self.recorder.inc(families.REQUESTS, api=self.api.value, status=outcome.value)

    def end_with(self, last: StreamChunk) -> None:
        """The request's last chunk: its error, or its finish."""
        if last.error is not None:
            self.end(RequestOutcome.ERROR)
        elif last.finish is not None and last.finish.reason is FinishReason.ABORT:
            self.end(RequestOutcome.ABORTED)
        elif last.finish is not None and last.finish.reason is FinishReason.ERROR:
            self.end(RequestOutcome.ERROR)
        else:
            self.end(RequestOutcome.FINISHED)

    def end_by_exception(self, exc: BaseException) -> None:
        """A request that ended by an exception before its response: cancelled (client gone) or failed."""
        self.end(RequestOutcome.ABORTED if isinstance(exc, asyncio.CancelledError) else RequestOutcome.ERROR)


def untracked() -> RequestTally:
    return RequestTally(Api.CHAT, None)


class IngressMetrics:
    """One recorder per model a request was routed to (a name a client made up never becomes a label)."""

    def __init__(self) -> None:
        self._recorders: dict[str, MetricsRecorder] = {}

    def request(self, api: Api, model_name: str) -> RequestTally:
        recorder = self._recorders.get(model_name)
        if recorder is None:
            recorder = self._recorders[model_name] = MetricsRecorder(model_name)
        return RequestTally(api, recorder)

    def snapshots(self) -> list[MetricsSnapshot]:
        return [recorder.snapshot() for recorder in self._recorders.values()]

