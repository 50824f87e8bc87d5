"""Admin routes of per-request LoRA adapters: POST /v1/admin/load-adapter and /v1/admin/unload-adapter.

A loaded adapter answers as model 'MODEL:NAME' on every generation route and is listed in /v1/models with
`parent` MODEL (adapter_catalog.py). Its folder follows the rules of a model folder: under model_roots (Orchard's
and Hugging Face's caches by default), no '..'.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from deployments.api.openapi_errors import ADMIN_LOAD, ADMIN_UNLOAD, error_responses
from deployments.ingress.adapter_catalog import Registry, SEPARATOR, load_adapter, split_adapter_id, unload_adapter
from engine.errors import InvalidRequestError

logger = logging.getLogger("ray.serve.orchard")


class LoadAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1, description="the base model the adapter was trained for")
    adapter: str = Field(min_length=1, description="its name: requests then send model 'MODEL:NAME'")
    path: str = Field(min_length=1, description="its folder (mlx-lm's or PEFT's format), under model_roots")


class UnloadAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1, description="the base model, or 'MODEL:NAME' (then adapter may be left out)")
    adapter: str | None = Field(None, description="the adapter's name")


def adapter_router(registry: Registry) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/admin/load-adapter", responses=error_responses(ADMIN_LOAD))
    async def load(body: LoadAdapterRequest) -> dict[str, Any]:
        """Register a LoRA adapter on a serving model and load it (a bad one is refused saying why)."""
        _log_unknown(body)
        ref = await load_adapter(registry, body.model, body.adapter, body.path)
        return {"status": "loaded", "id": f"{body.model}{SEPARATOR}{ref.name}", "model": body.model,
                "adapter": ref.name, "path": ref.path}

    @router.post("/v1/admin/unload-adapter", responses=error_responses(ADMIN_UNLOAD))
    async def unload(body: UnloadAdapterRequest) -> dict[str, Any]:
        """Requests can no longer name it; those running on it finish on it."""
        _log_unknown(body)
        model, adapter = body.model, body.adapter
        if adapter is None:
            split = split_adapter_id(body.model)
            if split is None:
                raise InvalidRequestError("Name the adapter: 'adapter', or model 'MODEL:NAME'", param="adapter")
            model, adapter = split
        await unload_adapter(registry, model, adapter)
        return {"status": "unloaded", "id": f"{model}{SEPARATOR}{adapter}", "model": model, "adapter": adapter}

    return router


def _log_unknown(body: BaseModel) -> None:
    if body.model_extra:
        logger.info("adapter route: ignored unknown fields %s", sorted(body.model_extra))
