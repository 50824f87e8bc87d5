"""Bodega's config.yaml (`server: {host, port}` + `models: [...]`, its "experimental" multi-model start) as the Ray
Serve config `orchard serve` runs: the ingress, one application per model (its entry as written: Bodega's field
names are ModelConfig's aliases, deployments/bodega.py), and the embedded embedder for Bodega's RAG routes."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from deployments.cli.server_client import ServerError
from deployments.config import ModelConfig, serve_app_name

BODEGA_PORT = 44468  # where a Bodega config serves unless its `server.port` says otherwise
IMPORT_PATH = "deployments.app:build_app"
SERVER_FIELDS = ("host", "port")
# /v1/rag/* embed with this model (IngressConfig's rag default), served beside the configured ones.
EMBEDDER = {"model_id": "all-MiniLM-L6-v2", "model_path": "default-embedding", "model_type": "embedding"}


def is_bodega_config(config: Any) -> bool:
    """Bodega's shape: a `models:` list and no Serve `applications:`."""
    return isinstance(config, dict) and "models" in config and "applications" not in config


def serve_config_of(bodega: dict[str, Any]) -> dict[str, Any]:
    """The Serve config of a Bodega config.yaml; ServerError naming the entry and field it cannot take."""
    server = bodega.get("server") or {}
    if not isinstance(server, dict):
        raise ServerError("'server' must be a mapping (host, port)")
    unknown = sorted(set(server) - set(SERVER_FIELDS))
    if unknown:
        raise ServerError(f"server.{unknown[0]}: not a setting Orchard reads from a Bodega config (host, port)")
    unexpected = sorted(set(bodega) - {"server", "models"})
    if unexpected:
        raise ServerError(f"'{unexpected[0]}': a Bodega config holds 'server' and 'models' only")
    applications = [{"name": "orchard", "route_prefix": "/", "import_path": IMPORT_PATH, "args": {}}]
    ids = [_model_id(index, entry) for index, entry in enumerate(_model_entries(bodega))]
    for model_id, entry in zip(ids, bodega["models"]):
        if ids.count(model_id) > 1:
            raise ServerError(f"model_id '{model_id}' is given to two models of 'models'")
        applications.append(_model_application(model_id, entry))
    if EMBEDDER["model_id"] not in ids:
        applications.append(_model_application(EMBEDDER["model_id"], EMBEDDER))
    http = {"host": str(server.get("host", "127.0.0.1")), "port": int(server.get("port", BODEGA_PORT))}
    return {"proxy_location": "HeadOnly", "http_options": http, "applications": applications}


def _model_entries(bodega: dict[str, Any]) -> list[Any]:
    models = bodega.get("models")
    if not isinstance(models, list) or not models:
        raise ServerError("'models' must be a list of model entries (model_path, model_id, model_type, ...)")
    return models


def _model_id(index: int, entry: Any) -> str:
    """The entry's id as Orchard gives it (model_id, else the path's last part), checked as a load body is."""
    try:
        return ModelConfig.model_validate(entry).id
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise ServerError(f"models[{index}]{'.' + where if where else ''}: {first['msg']}") from exc


def _model_application(model_id: str, entry: dict[str, Any]) -> dict[str, Any]:
    return {"name": serve_app_name(model_id), "route_prefix": None, "import_path": IMPORT_PATH,
            "args": {**entry, "model_id": model_id}}
