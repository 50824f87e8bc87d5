"""The HTTP front door: OpenAI and Anthropic routes (FastAPI), request ids, errors.

create_app(registry) builds the FastAPI app over any registry backend, so the same routes run under Ray Serve
(ingress/deployment.py) and in process in tests (httpx ASGI transport over ingress/local_models.py).
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from functools import partial
from typing import Any, AsyncIterator

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.errors import ModelNotFoundError, OrchardError
from deployments.ingress.adapter_catalog import SEPARATOR, adapter_cards, adapter_ref, split_adapter_id
from deployments.ingress.adapter_routes import adapter_router
from deployments.ingress.admin_routes import admin_router
from deployments.ingress.hub_routes import cache_listing, hub_router
from deployments.ingress.json_body import FastJsonRoute
from deployments.api.anthropic_convert import chat_prompt, messages_job
from deployments.api.anthropic_render import MessageMeta, MessagesRenderer
from deployments.api.anthropic_schemas import CountTokensRequest, MessagesRequest
from deployments.api.openai_convert import chat_job, completion_job
from deployments.api.errors import WireError, http_error, validation_error, wire_error, wire_error_for_path
from deployments.api.openapi_errors import (
    COUNT_TOKENS,
    EVENT_STREAM,
    GENERATION,
    MODEL_LISTING,
    MODEL_LOOKUP,
    STORED_RESPONSE,
    TOOL_LOOP_GENERATION,
    document_errors_as_sent,
    error_responses,
)
from deployments.api.openai_render import ChatRenderer, CompletionRenderer, ResponseMeta
from deployments.api.openai_objects import ModelCard, ModelList
from deployments.api.openai_schemas import ChatCompletionRequest, CompletionRequest
from deployments.api.responses_convert import responses_job
from deployments.api.responses_render import ResponsesRenderer, response_shell
from deployments.api.responses_schemas import ResponsesRequest
from deployments.api.mcp_requests import anthropic_mcp_use, responses_mcp_use
from deployments.mcp.hub import McpHub
from deployments.mcp.tool_loop import tool_loop_client
from deployments.mcp_calls import McpUse
from deployments.model_calls import GenerateJob
from deployments.ingress_config import DEFAULT_MAX_BODY_BYTES, MediaLimits, RagConfig
from deployments.ingress.auth import ApiKeyMiddleware, ApiKeys
from deployments.ingress.audio_routes import audio_router
from deployments.ingress.image_routes import image_router
from deployments.ingress.realtime_routes import realtime_router
from deployments.ingress.speech_routes import speech_router
from deployments.ingress.embedding_routes import embeddings_router
from deployments.ingress.edge import REQUEST_ID, REQUEST_PRIORITY, BodyLimitMiddleware, RequestIdMiddleware
from deployments.ingress.generation import KEEPALIVE_S, Renderer, answer
from deployments.ingress.rag_routes import MULTIPART_OVERHEAD_BYTES, UPLOAD_ROUTE, rag_router
from deployments.ingress.file_routes import FILES_MULTIPART_OVERHEAD_BYTES, FILES_ROUTE, files_router
from deployments.batches.batches import BatchStore
from deployments.batches.files import FileStore
from deployments.batches.runner import BatchRunner
from deployments.ingress.batch_routes import batches_router, internal_sender
from deployments.rag_calls import RagClient
from deployments.ingress.media_fetch import ImageLoader
from deployments.ingress.model_entries import ModelEntry, ModelStatus
from deployments.ingress.model_registry import Registry
from deployments.ingress.responses_store import ResponseStore
from deployments.metrics.exposition import CONTENT_TYPE, render_metrics
from deployments.metrics.ingress_metrics import Api, IngressMetrics

logger = logging.getLogger("ray.serve.orchard")

def create_app(
    registry: Registry,
    enable_admin: bool = True,
    keys: ApiKeys | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    keepalive_s: float = KEEPALIVE_S,
    responses: ResponseStore | None = None,
    media: MediaLimits | None = None,
    rag: RagClient | None = None,
    rag_max_upload_bytes: int = RagConfig().max_upload_bytes,
    mcp: McpHub | None = None,
    files: FileStore | None = None,
    batches: BatchStore | None = None,
    batch_headers: dict[str, str] | None = None,
) -> FastAPI:
    images = ImageLoader(media or MediaLimits())
    mcp = mcp or McpHub()  # none configured: a request naming a server is refused

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        runner = getattr(app.state, "batch_runner", None)
        if runner is not None:
            runner.resume()  # batches an earlier ingress left unfinished
        yield
        if runner is not None:
            await runner.close()
            await app.state.batch_client.aclose()
        await images.aclose()  # the remote-image client, if one was made
        await mcp.aclose()  # the declared MCP servers' sessions (stdio servers' processes end with them)

    app = FastAPI(title="Orchard", version="0.1.0", lifespan=lifespan)
    app.state.image_loader = images  # where no lifespan runs (httpx's ASGI transport), its owner closes it
    app.state.mcp = mcp
    metrics = IngressMetrics()
    # The last added runs first: request id, then the key check, then the body limit (no body read before both).
    upload_limit = {UPLOAD_ROUTE: rag_max_upload_bytes + MULTIPART_OVERHEAD_BYTES} if rag is not None else {}
    if files is not None:
        upload_limit[FILES_ROUTE] = files.max_bytes + FILES_MULTIPART_OVERHEAD_BYTES
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=max_body_bytes, path_limits=upload_limit)
    app.add_middleware(ApiKeyMiddleware, keys=keys or ApiKeys([]))
    app.add_middleware(RequestIdMiddleware)
    _install_error_handlers(app)
    app.include_router(openai_router(registry, images, metrics, keepalive_s))
    app.include_router(responses_router(registry, responses or ResponseStore(), images, metrics, mcp, keepalive_s))
    app.include_router(anthropic_router(registry, images, metrics, mcp, keepalive_s))
    app.include_router(embeddings_router(registry, metrics))
    app.include_router(audio_router(registry, metrics, keepalive_s))
    app.include_router(speech_router(registry, metrics, keepalive_s))
    app.include_router(realtime_router(registry))
    app.include_router(metrics_router(registry, metrics))
    if rag is not None:
        app.include_router(rag_router(rag, registry, metrics, keepalive_s))
    app.include_router(image_router(registry, metrics, keepalive_s))
    if files is not None:
        app.include_router(files_router(files))
    if files is not None and batches is not None:
        send, app.state.batch_client = internal_sender(app, batch_headers or {})
        app.state.batch_runner = BatchRunner(batches, files, send)
        app.include_router(batches_router(app.state.batch_runner))
    app.include_router(admin_router(registry, enable_admin))
    if enable_admin:
        app.include_router(adapter_router(registry))
    if enable_admin and registry.downloads is not None:  # no manager (or no admin API): no downloads
        app.include_router(hub_router(registry.downloads, registry, keepalive_s))
    document_errors_as_sent(app)
    return app


def metrics_router(registry: Registry, metrics: IngressMetrics) -> APIRouter:
    router = APIRouter()

    @router.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
    async def prometheus_metrics() -> Response:
        """Prometheus's text format: this ingress's request counts and every running model's metrics."""
        budget = registry.memory.snapshots() if registry.memory is not None else []
        snapshots = metrics.snapshots() + budget + await registry.metrics()
        return Response(render_metrics(snapshots), media_type=CONTENT_TYPE)

    return router


def openai_router(
    registry: Registry, images: ImageLoader, metrics: IngressMetrics, keepalive_s: float = KEEPALIVE_S
) -> APIRouter:
    router = APIRouter(route_class=FastJsonRoute)  # bodies of megabytes (images): json_body.py

    @router.post("/v1/chat/completions", responses={**EVENT_STREAM, **error_responses(GENERATION)})
    async def chat_completions(body: ChatCompletionRequest) -> Response:
        meta = ResponseMeta(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), body.model)
        job = chat_job(body, meta.id, REQUEST_ID.get())
        renderer = ChatRenderer(meta, _include_usage(body))
        return await _generation_response(registry, body.model, job, renderer, keepalive_s, images, metrics, Api.CHAT)

    @router.post("/v1/completions", responses={**EVENT_STREAM, **error_responses(GENERATION)})
    async def completions(body: CompletionRequest) -> Response:
        meta = ResponseMeta(f"cmpl-{uuid.uuid4().hex}", int(time.time()), body.model)
        job = completion_job(body, meta.id, REQUEST_ID.get())
        renderer = CompletionRenderer(meta, _include_usage(body))
        return await _generation_response(
            registry, body.model, job, renderer, keepalive_s, None, metrics, Api.COMPLETIONS
        )

    @router.get("/v1/models", responses=error_responses(MODEL_LISTING))
    async def list_models(
        verify_with_hub: bool = Query(False, description="check each cached repo against the Hugging Face Hub"),
    ) -> dict[str, Any]:
        """OpenAI's list of the loaded models, then the local Hugging Face cache's repos (with
        Bodega's size_gb, download_percentage, is_complete; a loaded model served from the cache carries them too)."""
        await registry.refresh()
        loaded = [e for e in registry.entries() if e.status in _LISTED]
        adapters = [_adapter_card(e, name) for e, name in await adapter_cards(registry, loaded)]
        unloaded = [ModelCard(id=c.id, created=0, owned_by="orchard", status="unloaded")
                    for c in registry.on_demand_unloaded()]  # on_demand: a request naming one loads it
        listing = ModelList(data=[_model_card(e) for e in loaded] + unloaded + adapters).dump()
        if registry.downloads is None:
            return listing
        cache = await cache_listing(registry.downloads, loaded, verify_with_hub)
        for card in listing["data"]:
            card.update(cache.loaded_fields.get(card["id"], {}))
        listing["data"].extend(cache.cards)
        return listing

    @router.get("/v1/models/{model_id:path}", responses=error_responses(MODEL_LOOKUP))
    async def get_model(model_id: str) -> dict[str, Any]:
        await registry.refresh()
        entry = registry.named(model_id)  # its id, or the model_path it was loaded from
        split = split_adapter_id(model_id) if entry is None else None
        base = registry.named(split[0]) if split is not None else None
        if base is not None and base.status in _LISTED and await adapter_ref(registry, base, split[1]) is not None:
            return _adapter_card(base, split[1]).dump()
        if entry is None or entry.status not in _LISTED:
            raise ModelNotFoundError(f"The model '{model_id}' does not exist", param="model")
        return _model_card(entry).dump()

    return router


def responses_router(
    registry: Registry, responses: ResponseStore, images: ImageLoader, metrics: IngressMetrics, mcp: McpHub,
    keepalive_s: float = KEEPALIVE_S,
) -> APIRouter:
    """OpenAI's Responses API on the chat path; stored responses live in this ingress (ingress/responses_store.py)."""
    router = APIRouter(route_class=FastJsonRoute)  # bodies of megabytes (images): json_body.py

    @router.post("/v1/responses", responses={**EVENT_STREAM, **error_responses(TOOL_LOOP_GENERATION)})
    async def create_response(body: ResponsesRequest) -> Response:
        response_id = f"resp_{uuid.uuid4().hex}"
        history = responses.history(body.previous_response_id) if body.previous_response_id else []
        request = responses_job(body, history, response_id, REQUEST_ID.get())
        use = responses_mcp_use(body, history, request.items)
        store = partial(responses.put, input_items=request.items, previous_id=body.previous_response_id)
        renderer = ResponsesRenderer(response_shell(body, request.tools, response_id, request.namespaces), store if body.stores else None)
        return await _generation_response(
            registry, body.model, request.job, renderer, keepalive_s, images, metrics, Api.RESPONSES, (mcp, use)
        )

    @router.get("/v1/responses/{response_id}", responses=error_responses(STORED_RESPONSE))
    async def get_response(response_id: str) -> dict[str, Any]:
        return responses.get(response_id)

    @router.delete("/v1/responses/{response_id}", responses=error_responses(STORED_RESPONSE))
    async def delete_response(response_id: str) -> dict[str, Any]:
        responses.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    return router


def anthropic_router(
    registry: Registry, images: ImageLoader, metrics: IngressMetrics, mcp: McpHub, keepalive_s: float = KEEPALIVE_S
) -> APIRouter:
    """Anthropic's Messages API; the `anthropic-version` / `anthropic-beta` headers are tolerated."""
    router = APIRouter(route_class=FastJsonRoute)  # bodies of megabytes (images): json_body.py

    @router.post("/v1/messages", responses={**EVENT_STREAM, **error_responses(TOOL_LOOP_GENERATION, anthropic=True)})
    async def messages(body: MessagesRequest) -> Response:
        message_id = f"msg_{uuid.uuid4().hex}"
        job = messages_job(body, message_id, REQUEST_ID.get())
        renderer = MessagesRenderer(MessageMeta(message_id, body.model))
        return await _generation_response(
            registry, body.model, job, renderer, keepalive_s, images, metrics, Api.MESSAGES,
            (mcp, anthropic_mcp_use(body)),
        )

    @router.post("/v1/messages/count_tokens", responses=error_responses(COUNT_TOKENS, anthropic=True))
    async def count_tokens(body: CountTokensRequest) -> dict[str, Any]:
        prompt = chat_prompt(body)
        client = await registry.route(body.model)
        await images.load(prompt)  # an image's tokens depend on its size: fetched as for an answer
        counted = await client.count_tokens(prompt)
        if counted.error is not None:
            raise counted.error
        return {"input_tokens": counted.input_tokens}

    return router


_LISTED = (ModelStatus.RUNNING, ModelStatus.LOADING)


def _model_card(entry: ModelEntry) -> ModelCard:
    created = entry.info.created_at if entry.info is not None else entry.seen_at
    return ModelCard(id=entry.model_id, created=created, owned_by="orchard", status=entry.status.value)


def _adapter_card(base: ModelEntry, name: str) -> ModelCard:
    card = _model_card(base)
    return ModelCard(id=f"{base.model_id}{SEPARATOR}{name}", created=card.created, owned_by=card.owned_by, status=card.status,
                     parent=base.model_id)


def _include_usage(body: ChatCompletionRequest | CompletionRequest) -> bool:
    return body.stream and body.stream_options is not None and body.stream_options.include_usage


async def _generation_response(
    registry: Registry, model_id: str, job: GenerateJob, renderer: Renderer, keepalive_s: float,
    images: ImageLoader | None, metrics: IngressMetrics, api: Api,
    tool_loop: tuple[McpHub, McpUse | None] | None = None,
) -> Response:
    """Route, make the job's images ready (limits, remote ones fetched: only once the model is known to serve),
    answer: from the model, or from the MCP tool loop over it where the request uses MCP servers (their tools are
    listed first: a server that cannot be reached is refused before the model is asked). Counted from the routing on
    (a request for a model that is not served names no metric)."""
    logger.info("request %s for model %s, stream=%s [X-Request-Id %s]", job.request_id, model_id, job.stream, job.log_id)
    job.priority = REQUEST_PRIORITY.get()
    client = await registry.route(model_id)
    tally = metrics.request(api, model_id)
    try:
        if images is not None:
            await images.load(job.prompt)
        if tool_loop is not None and tool_loop[1] is not None:
            client = await tool_loop_client(tool_loop[0], tool_loop[1], job, client)
    except BaseException as exc:
        tally.end_by_exception(exc)
        raise
    return await answer(client, job, renderer, keepalive_s, tally)


# ---- errors -------------------------------------------------------------------------------
def _error_response(request: Request, error: WireError) -> JSONResponse:
    error = wire_error_for_path(request.url.path, error)
    return JSONResponse(error.body, status_code=error.status, headers=error.headers)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OrchardError)
    async def orchard_error(request: Request, exc: OrchardError) -> JSONResponse:
        logger.info("%s %s -> %s: %s [request %s]", request.method, request.url.path, exc.code, exc.message, REQUEST_ID.get())
        return _error_response(request, wire_error(exc))

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error_response(request, validation_error(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def http_exception(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error_response(request, http_error(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error on %s %s [request %s]", request.method, request.url.path, REQUEST_ID.get())
        return _error_response(request, wire_error(exc))
