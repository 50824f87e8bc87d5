"""The response bodies the Bodega docs show (/work/shared/reference/bodega-docs.txt), copied as they are, and the
check that an answer has every documented field with the documented JSON type.

A documented value stands for its type: a string for any string, 4.8 for any number, 1704067200 for an integer,
true for a boolean, null for null; a list's first item for every item. Fields beyond the documented ones are
allowed (a client reads only what it knows).
"""

from __future__ import annotations

from typing import Any

# L111-116: a load's answer ("status": "loaded").
LOAD_ANSWER = {
    "status": "loaded",
    "model_id": "Qwen/Qwen3-30B-A3B-MLX-4bit",
    "model_path": "Qwen/Qwen3-30B-A3B-MLX-4bit",
    "model_type": "lm",
}

# L80-97 and L800-808: /health with models.
HEALTH_WITH_MODELS = {
    "status": "ok",
    "model_id": "bodega-solomon-9b, bodega-raptor-8b",
    "model_status": "initialized (2 model(s))",
    "models_detail": [
        {"id": "bodega-solomon-9b", "type": "multimodal", "status": "running", "ram_usage_mb": 11645.8},
        {"id": "bodega-raptor-8b", "type": "lm", "status": "running", "ram_usage_mb": 4558.4},
    ],
}

# L810-814: /health with no model loaded.
HEALTH_NO_MODELS = {"status": "unhealthy", "model_id": None, "model_status": "no_models"}

# L225-245: a chat completion.
CHAT_COMPLETION = {
    "id": "chatcmpl_1234567890",
    "object": "chat.completion",
    "created": 1677652288,
    "model": "bodega-raptor-8b",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Machine learning is a subset of artificial intelligence..."},
            "finish_reason": "stop",
        }
    ],
    "usage": {"prompt_tokens": 15, "completion_tokens": 120, "total_tokens": 135},
}

# L634-652: a completion of a model loaded with a draft model ("no extra fields": the same shape, plus usage's
# prompt_tokens_details).
SPECULATIVE_COMPLETION = {
    "id": "chatcmpl_2fa419e...",
    "object": "chat.completion",
    "model": "raptor-fast",
    "choices": [
        {"finish_reason": "stop", "index": 0, "message": {"content": "Here's your answer...", "role": "assistant"}}
    ],
    "usage": {"prompt_tokens": 21, "total_tokens": 121, "completion_tokens": 100,
              "prompt_tokens_details": {"cached_tokens": 3}},
}

# L498: deleting a cached model.
DELETED_MODEL = {"id": "mlx-community/Qwen3.5-27B-4bit", "object": "model", "deleted": True}

# L509-530: GET /v1/admin/loaded-models.
LOADED_MODELS = {
    "object": "list",
    "data": [
        {
            "id": "bodega-raptor-8b",
            "type": "lm",
            "model_path": "SRSWTI/bodega-raptor-8b-mxfp4",
            "context_length": 32768,
            "created_at": 1704067200,
            "status": "running",
            "pid": 83932,
            "memory": {"metal_active_mb": 4150.2, "metal_cache_mb": 0.0, "metal_peak_mb": 4150.2, "rss_mb": 408.2,
                       "total_mb": 4558.4},
        }
    ],
    "total": 1,
}

# L536-548: GET /v1/models (the local Hugging Face cache).
MODELS_LIST = {
    "object": "list",
    "data": [
        {
            "id": "SRSWTI/bodega-raptor-8b-mxfp4",
            "object": "model",
            "created": 1704067200,
            "owned_by": "SRSWTI",
            "size_gb": 4.8,
            "download_percentage": 100.0,
            "is_complete": True,
        }
    ],
}

# L851-856: POST /v1/rag/upload.
RAG_UPLOAD = {"file_id": "rag-c6cd8f10", "filename": "document.pdf", "num_chunks": 71, "status": "indexed"}

# OpenAI's error body, which the docs' error-handling example reads only by status code (L840-848); Orchard's
# typed errors carry it.
ERROR = {"error": {"message": "why", "type": "invalid_request_error", "code": "code"}}


def assert_documented_shape(actual: Any, documented: Any, where: str = "$") -> None:
    """Every field of `documented` is in `actual` with the same JSON type (recursively)."""
    if isinstance(documented, dict):
        assert isinstance(actual, dict), f"{where}: expected an object, got {actual!r}"
        for key, value in documented.items():
            assert key in actual, f"{where}: no '{key}' in {sorted(actual)}"
            assert_documented_shape(actual[key], value, f"{where}.{key}")
    elif isinstance(documented, list):
        assert isinstance(actual, list), f"{where}: expected a list, got {actual!r}"
        for index, item in enumerate(actual):
            if documented:
                assert_documented_shape(item, documented[0], f"{where}[{index}]")
    else:
        assert _json_type(actual) == _json_type(documented) or (
            _json_type(documented) == "number" and _json_type(actual) == "integer"), (
            f"{where}: expected {_json_type(documented)} like {documented!r}, got {actual!r}")


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return type(value).__name__


def assert_refused(response: Any, status: int, field: str, because: tuple[str, ...]) -> dict[str, Any]:
    """A typed error of `status` whose message (or param) names `field` and gives a reason: one of the `because`
    phrases is in the message (so pydantic's bare "Extra inputs are not permitted" is not enough)."""
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    assert_documented_shape(body, {"error": {"message": "why", "type": "invalid_request_error"}})
    error = body["error"]
    assert field in error["message"] or error.get("param") == field, error
    assert "Extra inputs are not permitted" not in error["message"], error
    assert any(reason in error["message"] for reason in because), error
    return error
