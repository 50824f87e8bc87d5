"""Bodega docs, "Getting Started" (L29-155) and the remote-image vision example (L284-308), replayed against one
server that starts with an empty Hugging Face cache: every load names a repo that is not downloaded yet."""

from __future__ import annotations

import re

import pytest

from tests.conformance import docs_snippets
from tests.conformance.bodega_server import absent, bodega_server, curl_json, ensure_loaded, loaded_models
from tests.conformance.conftest import BLACKBIRD, ORION, QWEN3_30B, RAPTOR, SOLOMON
from tests.conformance.docs_shapes import (
    CHAT_COMPLETION, HEALTH_WITH_MODELS, LOAD_ANSWER, assert_documented_shape, assert_refused,
)

RAPTOR_QUICK_START = {"model_path": RAPTOR, "model_id": "bodega-raptor-8b", "model_type": "lm",
                      "context_length": 32768, "prompt_cache_size": 10}  # L35-41, for examples that need it loaded
SOLOMON_SIDE_BY_SIDE = {"model_id": SOLOMON, "model_type": "multimodal", "model_path": SOLOMON}  # L62-66


@pytest.fixture(scope="module")
def requests(lm_folder, vlm_folder, tmp_path_factory):
    repos = {RAPTOR: lm_folder, ORION: lm_folder, BLACKBIRD: lm_folder, QWEN3_30B: lm_folder, SOLOMON: vlm_folder}
    with bodega_server(repos, tmp_path_factory.mktemp("hf-cache")) as server:
        yield server.requests


def test_E03_E04_quick_start_load_then_first_chat(requests):
    """L29-50: load raptor (prompt_cache_size 10), then the first chat; the load answers "loaded" (L111-116 shows
    the answer's shape) and the model serves at once (L381: "immediately available")."""
    absent(requests, "bodega-raptor-8b")
    loaded = curl_json(requests, "POST", "/v1/admin/load-model", """{
"model_path": "SRSWTI/bodega-raptor-8b-mxfp4",
"model_id": "bodega-raptor-8b",
"model_type": "lm",
"context_length": 32768,
"prompt_cache_size": 10
}""")
    assert loaded.status_code == 200, loaded.text
    assert loaded.json() == {**LOAD_ANSWER, "model_id": "bodega-raptor-8b", "model_path": RAPTOR}

    answer = curl_json(requests, "POST", "/v1/chat/completions", """{
"model": "bodega-raptor-8b",
"messages": [
{"role": "user", "content": "Hello, welcome to the world of dreamers?"}
]
}""")
    assert answer.status_code == 200, answer.text
    assert_documented_shape(answer.json(), CHAT_COMPLETION)
    assert answer.json()["model"] == "bodega-raptor-8b" and answer.json()["choices"][0]["finish_reason"] == "stop"


def test_E05_E06_E07_E08_three_models_side_by_side_then_health(requests):
    """L51-98: an lm, a multimodal model (its model_id a full repo path) and blackbird with harmony parsers and
    max_concurrency 1, each loaded by its own call; /health then lists them as L80-97 shows."""
    absent(requests, "bodega-orion-0.6b", SOLOMON, "blackbird")
    bodies = ["""{
"model_id": "bodega-orion-0.6b",
"model_type": "lm",
"model_path": "srswti/bodega-orion-0.6b"
}""", """{
"model_id": "srswti/bodega-solomon-9b",
"model_type": "multimodal",
"model_path": "srswti/bodega-solomon-9b"
}""", """{
"model_id": "blackbird",
"model_type": "lm",
"model_path": "srswti/blackbird-she-doesnt-refuse-21b",
"context_length": 32768,
"max_concurrency": 1,
"reasoning_parser": "harmony",
"tool_call_parser": "harmony"
}"""]
    for body in bodies:
        response = curl_json(requests, "POST", "/v1/admin/load-model", body)
        assert response.status_code == 200, response.text
        assert_documented_shape(response.json(), LOAD_ANSWER)
        assert response.json()["status"] == "loaded"

    health = curl_json(requests, "GET", "/health")
    assert health.status_code == 200, health.text
    body = health.json()
    assert_documented_shape(body, HEALTH_WITH_MODELS)
    detail = {model["id"]: model for model in body["models_detail"]}
    assert {"bodega-orion-0.6b": "lm", SOLOMON: "multimodal", "blackbird": "lm"}.items() <= {
        model_id: model["type"] for model_id, model in detail.items()}.items()
    assert all(model["status"] == "running" for model in detail.values()), detail
    assert body["status"] == "ok" and set(body["model_id"].split(", ")) == set(detail)
    assert re.fullmatch(r"initialized \((\d+) model\(s\)\)", body["model_status"])[1] == str(len(detail))
    assert loaded_models(requests)["blackbird"]["context_length"] == 32768


def test_E09_community_qwen_with_continuous_batching_answers_loaded(requests):
    """L98-117: any Hugging Face repo, with the cb_* knobs, queue_timeout and queue_size; the answer is exactly
    L111-116. queue_size 100 and cb_max_num_seqs 256 show in /v1/queue/stats as the model's limits."""
    absent(requests, QWEN3_30B)
    response = curl_json(requests, "POST", "/v1/admin/load-model", """{
"model_id": "Qwen/Qwen3-30B-A3B-MLX-4bit",
"model_type": "lm",
"model_path": "Qwen/Qwen3-30B-A3B-MLX-4bit",
"max_concurrency": 1,
"queue_timeout": 300,
"queue_size": 100,
"continuous_batching": true,
"cb_max_num_seqs": 256,
"cb_prefill_batch_size": 16,
"cb_completion_batch_size": 32
}""")
    assert response.status_code == 200, response.text
    assert response.json() == LOAD_ANSWER  # "| python3 -m json.tool" prints exactly this
    rows = {row["id"]: row for row in requests.get("http://localhost:44468/v1/queue/stats").json()["models"]}
    assert (rows[QWEN3_30B]["queue_capacity"], rows[QWEN3_30B]["max_num_seqs"]) == (100, 256)


def test_E11_E12_python_client_load_then_chat(requests):
    """L131-155: the Python client loads raptor without model_id (Orchard names it "bodega-raptor-8b-mxfp4"; Bodega
    says the id "defaults to path", L437), prints the answer, then chats with "bodega-raptor-8b", which the quick
    start (L33-41) loaded; the docs' own example mixes the two."""
    ensure_loaded(requests, RAPTOR_QUICK_START)
    absent(requests, "bodega-raptor-8b-mxfp4")
    ran = docs_snippets.run(docs_snippets.quick_start, requests)
    loaded, chat = ran.value
    assert loaded.status_code == 200, loaded.text
    assert loaded.json() == {**LOAD_ANSWER, "model_id": "bodega-raptor-8b-mxfp4", "model_path": RAPTOR}
    assert chat.status_code == 200 and isinstance(chat.json()["choices"][0]["message"]["content"], str)
    assert ran.printed.startswith("{'status': 'loaded'")


def test_E20_a_remote_image_url_is_refused_saying_which_setting_allows_it(requests):
    """L284-308: an https image URL. Refused on purpose (400): fetching a client-named URL from the server is off
    by default (SSRF); the message names the operator setting, allow_remote_media, and the data-URL way (L309)."""
    ensure_loaded(requests, SOLOMON_SIDE_BY_SIDE)
    response = curl_json(requests, "POST", "/v1/chat/completions", """{
"model": "srswti/bodega-solomon-9b",
"messages": [
{
"role": "user",
"content": [
{
"type": "text",
"text": "What is in this image? Provide a detailed description."
},
{
"type": "image_url",
"image_url": {
"url": "https://weblog.spots.ag/08-2018/aventador_svj_official/th.jpg"
}
}
]
}
],
"max_tokens": 300
}""")
    error = assert_refused(response, 400, "messages.0.content.1", ("allow_remote_media",))
    assert "data:image" in error["message"]
