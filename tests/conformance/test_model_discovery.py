"""Bodega docs, "Model Discovery" (L531-568) and deleting cached models (L494-499): the local Hugging Face cache
listed, downloaded into (plainly and with SSE progress) and deleted from, against the Hub stand-in."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conformance import docs_snippets
from tests.conformance.bodega_server import (
    BASE_URL, absent, bodega_server, curl_json, ensure_downloaded, ensure_loaded,
)
from tests.conformance.conftest import QWEN35_VL, RAPTOR
from tests.conformance.docs_shapes import DELETED_MODEL, MODELS_LIST, assert_documented_shape

RAPTOR_QUICK_START = {"model_path": RAPTOR, "model_id": "bodega-raptor-8b", "model_type": "lm",
                      "context_length": 32768, "prompt_cache_size": 10}  # L35-41


@pytest.fixture(scope="module")
def server(lm_folder, tmp_path_factory):
    # The 27B vision repo only has to be cached and deleted here: the tiny llama stands in for it.
    with bodega_server({RAPTOR: lm_folder, QWEN35_VL: lm_folder}, tmp_path_factory.mktemp("hf-cache")) as running:
        yield running


@pytest.fixture
def requests(server):
    return server.requests


def cached_models(requests, **params) -> dict[str, dict]:
    response = requests.get(f"{BASE_URL}/v1/models", params=params)
    assert response.status_code == 200, response.text
    assert_documented_shape(response.json(), MODELS_LIST)
    return {model["id"]: model for model in response.json()["data"]}


def not_cached(requests, repo_id: str) -> None:
    """Set up a docs example that downloads: the repo unloaded and deleted from the cache."""
    absent(requests, "bodega-raptor-8b")
    if repo_id in cached_models(requests):
        assert requests.delete(f"{BASE_URL}/v1/models/local/{repo_id}").status_code == 200


def test_E37_download_model_with_model_path(requests):
    """L549-553: {"model_path": ...} starts the download (the docs show no answer: a 2xx); it is then listed as a
    complete cached model."""
    not_cached(requests, RAPTOR)
    response = curl_json(requests, "POST", "/v1/admin/download-model",
                         """{"model_path": "SRSWTI/bodega-raptor-8b-mxfp4"}""")
    assert response.status_code in (200, 202), response.text
    ensure_downloaded(requests, RAPTOR)  # joins the download just started, returns when it ends
    assert cached_models(requests)[RAPTOR]["is_complete"] is True


def test_E38_download_stream_read_by_the_docs_loop(requests):
    """L553-568: the Python client reads `data:` lines, progress['status'], progress.get('progress'), and
    current_file while there is one; the stream ends with the completed event at 100%."""
    not_cached(requests, RAPTOR)
    ran = docs_snippets.run(docs_snippets.download_with_progress, requests)
    events = ran.value
    assert events and all(isinstance(event["status"], str) for event in events)
    assert (events[-1]["status"], events[-1]["progress"]) == ("completed", 100.0)
    files = [event["current_file"] for event in events if event["status"] == "downloading"]
    assert any(isinstance(name, str) and name.endswith(".safetensors") for name in files), events
    assert "completed — 100.0%" in ran.printed and "File: model.safetensors" in ran.printed


def test_E36_models_lists_the_cache_with_owner_size_and_completeness(requests):
    """L531-549: every listed model has the documented fields; a cached repo is listed under its repo id, owned by
    the repo's owner ("SRSWTI"), even while it is loaded under another id; ?verify_with_hub=true answers the same
    list."""
    ensure_downloaded(requests, RAPTOR)
    ensure_loaded(requests, RAPTOR_QUICK_START)
    assert curl_json(requests, "GET", "/v1/models").status_code == 200
    listed = cached_models(requests)
    raptor = listed[RAPTOR]
    assert (raptor["object"], raptor["owned_by"]) == ("model", "SRSWTI")
    assert (raptor["download_percentage"], raptor["is_complete"]) == (100.0, True)  # size_gb: a number (~0.0 GB)
    verified = cached_models(requests, verify_with_hub="true")
    assert verified[RAPTOR]["is_complete"] is True and verified[RAPTOR]["owned_by"] == "SRSWTI"
    absent(requests, "bodega-raptor-8b")


def test_E34_delete_a_cached_model_with_curl_python_and_the_endpoint_path(requests):
    """L494-499: curl on /v1/models/local/{id} answers {"id", "object": "model", "deleted": true}; the Python client
    prints it; the "Endpoint:" line's DELETE /v1/models/{model_id} (L495) deletes too."""
    ensure_downloaded(requests, QWEN35_VL)
    response = curl_json(requests, "DELETE", "/v1/models/local/mlx-community/Qwen3.5-27B-4bit")
    assert response.status_code == 200, response.text
    assert {key: response.json()[key] for key in DELETED_MODEL} == DELETED_MODEL
    assert QWEN35_VL not in cached_models(requests)

    absent(requests, "bodega-raptor-8b")
    ensure_downloaded(requests, RAPTOR)
    ran = docs_snippets.run(docs_snippets.delete_cached_raptor, requests)
    assert ran.value.status_code == 200, ran.value.text
    assert ran.printed.startswith("{'id': 'SRSWTI/bodega-raptor-8b-mxfp4', 'object': 'model', 'deleted': True")

    ensure_downloaded(requests, RAPTOR)
    response = curl_json(requests, "DELETE", "/v1/models/SRSWTI/bodega-raptor-8b-mxfp4")
    assert response.status_code == 200, response.text
    assert {key: response.json()[key] for key in DELETED_MODEL} == {**DELETED_MODEL, "id": RAPTOR}
    assert RAPTOR not in cached_models(requests)


def test_E34_a_running_model_is_unloaded_before_its_files_are_deleted(requests):
    """L494: "The model must be unloaded first if it is currently running": the delete is refused (409, saying to
    unload it) while raptor serves from the repo, and succeeds after the unload."""
    ensure_downloaded(requests, RAPTOR)
    ensure_loaded(requests, RAPTOR_QUICK_START)
    refused = requests.delete(f"{BASE_URL}/v1/models/local/{RAPTOR}")
    assert refused.status_code == 409 and "unload" in refused.json()["error"]["message"], refused.text
    absent(requests, "bodega-raptor-8b")
    assert requests.delete(f"{BASE_URL}/v1/models/local/{RAPTOR}").status_code == 200


def test_E37_E03_E35_a_load_during_the_download_joins_it(server, requests):
    """L549-553 then L33-41: download-model answers at once, so a reader's next step, the quick start's load, comes
    while the repo still downloads: the load joins that download (one transfer) and answers "loaded" when the model
    serves. Meanwhile the docs' loaded-models loop (L502-508) reads the loading model without error."""
    not_cached(requests, RAPTOR)
    gets_before = len(server.hub.file_gets(RAPTOR, "model.safetensors"))
    server.hub.bytes_per_second = 300_000  # the weights take ~1 s
    try:
        started = requests.post(f"{BASE_URL}/v1/admin/download-model", json={"model_path": RAPTOR})
        assert started.status_code in (200, 202), started.text
        with ThreadPoolExecutor(1) as pool:
            loading = pool.submit(requests.post, f"{BASE_URL}/v1/admin/load-model", json=RAPTOR_QUICK_START)
            ran = docs_snippets.run(docs_snippets.print_loaded_models, requests)
            while "bodega-raptor-8b" not in {m["id"] for m in ran.value} and not loading.done():
                time.sleep(0.02)
                ran = docs_snippets.run(docs_snippets.print_loaded_models, requests)
            loaded = loading.result()
    finally:
        server.hub.bytes_per_second = None
    assert "[LOADING] bodega-raptor-8b — PID: None" in ran.printed
    assert loaded.status_code == 200 and loaded.json()["status"] == "loaded", loaded.text
    assert len(server.hub.file_gets(RAPTOR, "model.safetensors")) == gets_before + 1  # one transfer for both
    absent(requests, "bodega-raptor-8b")
