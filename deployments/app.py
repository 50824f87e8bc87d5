"""Application builders for serve_config.yaml (`import_path: deployments.app:build_app`).

One builder for every application: args holding `model_path` build a model application
(its Serve application name must equal the model id), any other args build the ingress.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ray.serve import Application

from engine.errors import InvalidRequestError
from deployments.config import ModelConfig
from deployments.ingress_config import IngressConfig
from deployments.model_sources import check_model_sources
from deployments.ingress.deployment import Ingress
from deployments.model.deployment import build_model_application
from deployments.rag.deployment import RagServer


def build_app(args: dict[str, Any]) -> Application:
    args = dict(args or {})
    if "model_path" in args:
        return build_model_app(args)
    return build_ingress_app(args)


def build_model_app(args: dict[str, Any]) -> Application:
    config = ModelConfig.model_validate(args)
    try:
        # Relative paths in serve_config.yaml are relative to where `serve run` was started.
        config = check_model_sources(config, base_dir=Path.cwd())
    except InvalidRequestError as exc:
        raise ValueError(f"model '{config.id}': {exc.message}") from exc
    return build_model_application(config)


def build_ingress_app(args: dict[str, Any]) -> Application:
    """The ingress, and beside it in its application the RAG deployment (unless `rag: null`)."""
    config = IngressConfig.model_validate(args)
    rag = None
    if config.rag is not None:
        rag = RagServer.options(**config.rag_deployment_options()).bind(config.rag.model_dump())
    return Ingress.options(**config.deployment_options()).bind(config.model_dump(), rag)
