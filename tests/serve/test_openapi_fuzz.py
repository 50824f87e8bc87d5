"""Schemathesis over the ingress's own OpenAPI spec, in process on a tiny model: no answer is a server error, and
every answer's status, content type and body are ones the spec documents.

The stack lives on an event loop of its own thread (its registry and engine are bound to that loop), and each
generated case is sent there through httpx's ASGI transport.
"""

from __future__ import annotations

import asyncio
import importlib.util
import threading
import zlib
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import hypothesis
import pytest
import schemathesis
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from deployments.config import ModelConfig
from deployments.ingress_config import RagConfig
from deployments.ingress.auth import ApiKeys
from deployments.ingress.model_registry import Registry
from deployments.ingress.routes import create_app
from deployments.rag_calls import RagClient
from deployments.hub.downloads import DownloadManager
from tests.serve.local_stack import LocalStack, local_stack

MODEL = "tiny/alpha"
HAS_RAG_EXTRA = all(importlib.util.find_spec(name) for name in ("faiss", "pypdf"))
ADMIN_KEY = "fuzz-admin-key"
# Generated cases per operation (fuzzing phase); the coverage phase adds its boundary values (~2,600 cases in all).
EXAMPLES_PER_OPERATION = 25
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]

# Hugging Face downloads against a Hub nobody listens at: every download fails fast, as a documented answer.
UNREACHABLE_HUB = "http://127.0.0.1:9"

SCHEMA = schemathesis.openapi.from_dict(
    # The spec depends neither on the registry's contents nor on the RAG client or the download manager (only on
    # there being one).
    create_app(Registry(backend=None, downloads=DownloadManager(cache_dir=Path("unused"), endpoint=UNREACHABLE_HUB)),
               rag=cast(RagClient, object()) if HAS_RAG_EXTRA else None).openapi(),
    config=schemathesis.Config.from_dict({
        "seed": 25,
        "generation": {"max-examples": EXAMPLES_PER_OPERATION, "database": "none"},
        "phases": {"stateful": {"enabled": False}},
    }),
)


@dataclass
class LoopStack:
    """A local stack running on its own event loop's thread; `call` runs a coroutine there."""

    loop: asyncio.AbstractEventLoop
    stack: LocalStack

    def call(self, coro: Coroutine[Any, Any, Any], timeout_s: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)


@pytest.fixture(scope="module")
def running(tiny_models, tmp_path_factory) -> Iterator[LoopStack]:
    # A short context bounds any generated max_tokens; model_roots is an empty folder, so no admin load is accepted.
    config = ModelConfig(model_id=MODEL, model_path=str(tiny_models.alpha), context_length=64)
    roots = tmp_path_factory.mktemp("no-models")
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="fuzz-stack-loop", daemon=True)
    thread.start()
    # RAG without its embedder (not loaded, to keep torch out of this test): validation, 404s and 503s are fuzzed.
    rag = RagConfig(storage_dir=str(tmp_path_factory.mktemp("fuzz-rag"))) if HAS_RAG_EXTRA else None
    downloads = DownloadManager(cache_dir=tmp_path_factory.mktemp("fuzz-hf-cache"), endpoint=UNREACHABLE_HUB)
    context = local_stack([config], tmp_path_factory.mktemp("fuzz-state"), model_roots=[str(roots)],
                          keys=ApiKeys(["fuzz-inference-key"], ADMIN_KEY), rag=rag, downloads=downloads)
    try:
        stack = asyncio.run_coroutine_threadsafe(context.__aenter__(), loop).result(120)
        yield LoopStack(loop, stack)
        asyncio.run_coroutine_threadsafe(context.__aexit__(None, None, None), loop).result(120)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def _aim_at_the_model(case: schemathesis.Case) -> None:
    """Half of the bodies that name a model name the served one, so generated parameters reach the engine."""
    body = case.body
    if isinstance(body, dict) and isinstance(body.get("model"), str) and zlib.crc32(repr(body).encode()) % 2:
        body["model"] = MODEL
    if isinstance(body, dict) and body.get("model_path") in ("default", "default-embedding"):
        hypothesis.reject()  # the embedded models need no model_roots: a load of one would really run


async def _send(stack: LocalStack, request: dict[str, Any]):
    return await stack.http.request(
        request["method"],
        request["url"],
        headers=request["headers"],
        params=request.get("params"),
        json=request.get("json"),
        content=request.get("data"),
    )


@SCHEMA.parametrize()
@hypothesis.settings(deadline=None, suppress_health_check=list(hypothesis.HealthCheck))
def test_every_answer_is_documented_and_none_is_a_server_error(case, running):
    _aim_at_the_model(case)
    request = case.as_transport_kwargs(base_url="http://orchard", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    response = running.call(_send(running.stack, request))
    case.validate_response(response, checks=CHECKS)
