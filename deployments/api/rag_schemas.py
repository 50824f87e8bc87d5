"""/v1/rag/* bodies (Bodega's routes): the query request, and documents, sources and answers as JSON.

An answer is a chat completion (streamed or not) of the chosen model, as /v1/chat/completions sends it, with the
sources added: a top-level `sources` list in the JSON body, and in the stream's first chunk (the role chunk).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from deployments.api.openai_render import ChatRenderer, ResponseMeta
from deployments.api.openai_schemas import ChatCompletionRequest, StreamOptions
from deployments.api.request_limits import refuse_invalid_unicode
from deployments.api.unknown_fields import accept_unknown_fields
from deployments.model_calls import StreamChunk
from deployments.rag_calls import DocumentInfo, RetrievalJob, SearchHit
from engine.errors import InvalidRequestError

MAX_QUERY_CHARS = 32_000
MAX_FILE_IDS = 256
# The chat fields a query passes on to the answering model as they are.
_GENERATION_FIELDS = (
    "max_tokens", "max_completion_tokens", "temperature", "top_p", "min_p", "seed", "stop", "stream_options",
    "chat_template_kwargs",
)


class RagQueryRequest(BaseModel):
    model_config = ConfigDict(extra="allow", protected_namespaces=(), allow_inf_nan=False)

    query: str = Field(min_length=1, max_length=MAX_QUERY_CHARS)
    file_id: str | list[str] | None = None  # one document or several (Bodega's field)
    file_ids: list[str] | None = Field(None, max_length=MAX_FILE_IDS)
    top_k: int = Field(5, ge=1)  # chunks retrieved (not the sampler's top_k)
    retrieval_only: bool = False  # the sources alone: no model, no generation
    model: str | None = Field(None, min_length=1)
    stream: bool = False
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream_options: StreamOptions | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, body: Any) -> Any:
        return refuse_invalid_unicode(body)

    @model_validator(mode="after")
    def _checked(self) -> "RagQueryRequest":
        accept_unknown_fields("rag", self.model_extra)
        if not self.file_ids_named():
            raise ValueError("name the documents to search: 'file_id' (one or a list) or 'file_ids'")
        if len(self.file_ids_named()) > MAX_FILE_IDS:
            raise ValueError(f"at most {MAX_FILE_IDS} documents per query")
        if not self.retrieval_only and self.model is None:
            raise ValueError("'model' is required unless 'retrieval_only' is true")
        return self

    def file_ids_named(self) -> list[str]:
        given = [self.file_id] if isinstance(self.file_id, str) else list(self.file_id or [])
        return list(dict.fromkeys(given + list(self.file_ids or [])))

    def retrieval(self, log_id: str) -> RetrievalJob:
        return RetrievalJob(self.file_ids_named(), self.query, self.top_k, log_id)

    def chat_request(self) -> ChatCompletionRequest:
        """The answering request as /v1/chat/completions would get it (its checks apply); the RAG deployment
        replaces the question with the prompt over the sources."""
        fields = {name: getattr(self, name) for name in _GENERATION_FIELDS if getattr(self, name) is not None}
        try:
            return ChatCompletionRequest.model_validate({
                "model": self.model, "stream": self.stream, "messages": [{"role": "user", "content": self.query}],
                **{name: value.model_dump() if isinstance(value, BaseModel) else value for name, value in fields.items()},
            })
        except ValueError as exc:  # pydantic's ValidationError: the first problem, named
            errors = getattr(exc, "errors", lambda: [])()
            first = errors[0] if errors else {"loc": (), "msg": str(exc)}
            param = ".".join(str(part) for part in first["loc"]) or None
            raise InvalidRequestError(f"{param}: {first['msg']}" if param else first["msg"], param=param) from exc


def document_out(document: DocumentInfo, status: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"object": "rag.document", **dataclasses.asdict(document)}
    body["created_at"] = int(document.created_at)
    if status is not None:
        # Bodega's upload answers status "indexed"; the same bytes uploaded again are indexed already (kept once).
        body["status"] = "indexed"
        body["already_indexed"] = status == "already_indexed"
    return body


def sources_out(sources: list[SearchHit]) -> list[dict[str, Any]]:
    return [
        {"file_id": s.file_id, "filename": s.filename, "page": s.page, "chunk": s.chunk, "score": round(s.score, 6),
         "text": s.text}
        for s in sources
    ]


class RagChatRenderer(ChatRenderer):
    """A chat completion with the sources it was answered from."""

    def __init__(self, meta: ResponseMeta, include_usage: bool = False) -> None:
        super().__init__(meta, include_usage)
        self.sources: list[SearchHit] = []  # set once retrieval is done, before the first chunk is rendered

    def completion(self, parts: list[StreamChunk]) -> dict[str, Any]:
        return {**super().completion(parts), "sources": sources_out(self.sources)}

    def opening_payloads(self) -> list[dict[str, Any]]:
        payloads = super().opening_payloads()
        if payloads:
            payloads[0]["sources"] = sources_out(self.sources)
        return payloads
