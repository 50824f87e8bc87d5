"""Bodega docs, "Model Management" (L380-493) and the advanced features' load bodies (L600-678), replayed against one
server whose Hugging Face cache starts empty: each documented load body answers 200 "loaded" with the model
serving, and every field of the load-model table (L433-487) is accepted with its documented meaning. (The fields
refused on purpose are in test_admin_refusals.py.)

Many docs bodies load raptor without model_id, so under Orchard's id "bodega-raptor-8b-mxfp4": each test unloads
what it loaded, as a reader trying one example after another would.
"""

from __future__ import annotations

import base64

import pytest

from tests.conformance import docs_snippets
from tests.conformance.bodega_server import (
    BASE_URL, absent, bodega_server, curl_json, ensure_downloaded, ensure_loaded, loaded_models,
)
from tests.conformance.conftest import (
    ORION, QWEN35_VL, QWEN3_8B, QWEN3_DRAFT, RAPTOR, RAPTOR_09B,
)
from tests.conformance.docs_shapes import (
    CHAT_COMPLETION, LOAD_ANSWER, SPECULATIVE_COMPLETION, assert_documented_shape,
)
from tests.support.vlm_images import png_bytes

RAPTOR_ID = "bodega-raptor-8b-mxfp4"  # Orchard's id for raptor loaded without model_id
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(lm_folder, vlm_folder, tmp_path_factory):
    repos = {RAPTOR: lm_folder, RAPTOR_09B: lm_folder, ORION: lm_folder, QWEN3_8B: lm_folder, QWEN3_DRAFT: lm_folder,
             QWEN35_VL: vlm_folder}
    with bodega_server(repos, tmp_path_factory.mktemp("hf-cache")) as running:
        yield running


@pytest.fixture
def requests(server):
    return server.requests


def load(requests, body: str, model_id: str, model_path: str = RAPTOR, model_type: str = "lm") -> None:
    """A docs load body (curl text) from a server without that id: 200 with the documented answer (L111-116)."""
    absent(requests, model_id)
    response = curl_json(requests, "POST", "/v1/admin/load-model", body)
    assert response.status_code == 200, response.text
    assert response.json() == {"status": "loaded", "model_id": model_id, "model_path": model_path,
                               "model_type": model_type}


def unload(requests, name: str, model_id: str) -> None:
    """Unload by `name` (an id or a model_path): 200 "unloaded" once it is gone from loaded-models."""
    response = requests.delete(f"{BASE_URL}/v1/admin/unload-model/{name}")
    assert response.status_code == 200, response.text
    assert response.json() == {"status": "unloaded", "model_id": model_id}
    assert model_id not in loaded_models(requests)


def test_E27_raptor_with_max_concurrency_and_prompt_cache(requests):
    """L382-392 (the "Load Model" example): context_length shows in loaded-models as loaded."""
    load(requests, """{
"model_path": "SRSWTI/bodega-raptor-8b-mxfp4",
"model_id": "bodega-raptor-8b",
"model_type": "lm",
"context_length": 32768,
"max_concurrency": 1,
"prompt_cache_size": 10
}""", "bodega-raptor-8b")
    assert loaded_models(requests)["bodega-raptor-8b"]["context_length"] == 32768
    unload(requests, "bodega-raptor-8b", "bodega-raptor-8b")


def test_E29_python_load_with_qwen3_parsers_then_address_it_by_its_path(requests):
    """L399-411: loaded without model_id, the model answers to its model_path (Bodega's id "defaults to path",
    L437) as well as to Orchard's id; "Works with full path model IDs too" (L492) unloads it by that path."""
    absent(requests, RAPTOR_ID, "bodega-raptor-8b")  # no other model of that path: the path names one model
    ran = docs_snippets.run(docs_snippets.load_with_qwen3_parsers, requests)
    assert ran.value.status_code == 200, ran.value.text
    assert ran.value.json() == {**LOAD_ANSWER, "model_id": RAPTOR_ID, "model_path": RAPTOR}
    for name in (RAPTOR, RAPTOR_ID):
        answer = requests.post(f"{BASE_URL}/v1/chat/completions", json={"model": name, "messages": HI})
        assert answer.status_code == 200, answer.text
        assert_documented_shape(answer.json(), CHAT_COMPLETION)
    unload(requests, RAPTOR, RAPTOR_ID)


def test_E30_community_text_generation_model_as_lm(requests):
    """L411-422: a text-generation repo loaded as lm."""
    load(requests, """{
"model_id": "qwen3-8b",
"model_type": "lm",
"model_path": "mlx-community/Qwen3-8B-4bit",
"context_length": 32768
}""", "qwen3-8b", QWEN3_8B)
    unload(requests, "qwen3-8b", "qwen3-8b")


def test_E31_community_vision_model_as_multimodal_takes_images(requests):
    """L424-433: an image-text-to-text repo loaded as multimodal (context_length 16384); "you can pass images in
    the standard image_url content block format just like with bodega-solomon-9b" (E21's message, L318-326)."""
    load(requests, """{
"model_id": "qwen3.5-27b-vl",
"model_type": "multimodal",
"model_path": "mlx-community/Qwen3.5-27B-4bit",
"context_length": 16384
}""", "qwen3.5-27b-vl", QWEN35_VL, "multimodal")
    model = loaded_models(requests)["qwen3.5-27b-vl"]
    assert (model["type"], model["context_length"]) == ("multimodal", 16384)
    image = base64.b64encode(png_bytes(56, 56, seed=5)).decode()
    answer = requests.post(f"{BASE_URL}/v1/chat/completions", json={"model": "qwen3.5-27b-vl", "messages": [{
        "role": "user", "content": [{"type": "text", "text": "Extract all text from this scanned document."},
                                    {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}}]}]})
    assert answer.status_code == 200, answer.text
    unload(requests, "qwen3.5-27b-vl", "qwen3.5-27b-vl")


def test_E33_unload_by_model_id_and_by_full_path(requests):
    """L489-493: DELETE /v1/admin/unload-model/{model_id} by id (curl and Python) and by a full path
    (srswti/bodega-orion-0.6b, loaded as L55-58 loads it); each answers once the model is gone (L489:
    "instantly freeing"). bodega-raptor-0.9b is SRSWTI/bodega-raptor-0.9b (L829) loaded without model_id."""
    raptor_09b = {"model_path": RAPTOR_09B, "model_type": "lm"}
    ensure_loaded(requests, raptor_09b)
    ensure_loaded(requests, {"model_id": "bodega-orion-0.6b", "model_type": "lm", "model_path": ORION})
    response = curl_json(requests, "DELETE", "/v1/admin/unload-model/bodega-raptor-0.9b")
    assert (response.status_code, response.json()) == (200, {"status": "unloaded", "model_id": "bodega-raptor-0.9b"})
    response = curl_json(requests, "DELETE", "/v1/admin/unload-model/srswti/bodega-orion-0.6b")
    assert (response.status_code, response.json()) == (200, {"status": "unloaded", "model_id": "bodega-orion-0.6b"})
    assert not {"bodega-raptor-0.9b", "bodega-orion-0.6b"} & set(loaded_models(requests))

    ensure_loaded(requests, raptor_09b)
    ran = docs_snippets.run(docs_snippets.unload_raptor_09b, requests)
    assert ran.value.status_code == 200
    assert ran.printed == "{'status': 'unloaded', 'model_id': 'bodega-raptor-0.9b'}\n"


def test_E42_prompt_cache_size_25(requests):
    """L600-607: Bodega's prompt cache slots; Orchard's prefix cache serves the repeated prompt (cached tokens)."""
    load(requests, """{
"model_path": "SRSWTI/bodega-raptor-8b-mxfp4",
"model_type": "lm",
"prompt_cache_size": 25
}""", RAPTOR_ID)
    question = [{"role": "system", "content": "Answer briefly and plainly. " * 20}, *HI]
    usages = [requests.post(f"{BASE_URL}/v1/chat/completions", json={"model": RAPTOR_ID, "messages": question}).json()
              ["usage"] for _ in range(2)]
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] > 0, usages
    unload(requests, RAPTOR_ID, RAPTOR_ID)


def test_E43_draft_model_named_by_repo_id(requests):
    """L617-624: speculative decoding with a draft model named by its Hugging Face repo id, loaded like the target
    ("load any HuggingFace model directly", L98): the draft is not downloaded beforehand either."""
    load(requests, """{
"model_path": "SRSWTI/bodega-raptor-8b-mxfp4",
"model_type": "lm",
"draft_model_path": "Qwen/Qwen3-0.6B-MLX-4bit",
"num_draft_tokens": 4
}""", RAPTOR_ID)
    unload(requests, RAPTOR_ID, RAPTOR_ID)


def test_E44_E45_speculative_completion_has_the_standard_shape(requests):
    """L624-653: config.yaml's raptor-fast entry (L626-630) as a load body, with its lowercase srswti/ path for the
    SRSWTI/ repo the cache holds (L130 vs L551: one repo); its completion has the documented shape (L634-652)."""
    for repo in (RAPTOR, QWEN3_DRAFT):  # downloaded first: this example is about the answer, not the download
        ensure_downloaded(requests, repo)
    absent(requests, "raptor-fast")
    loaded = requests.post(f"{BASE_URL}/v1/admin/load-model", json={
        "model_id": "raptor-fast", "model_type": "lm", "model_path": "srswti/bodega-raptor-8b-mxfp4",
        "draft_model_path": "Qwen/Qwen3-0.6B-MLX-4bit", "num_draft_tokens": 3})
    assert loaded.status_code == 200, loaded.text
    answer = requests.post(f"{BASE_URL}/v1/chat/completions", json={"model": "raptor-fast", "messages": HI})
    assert answer.status_code == 200, answer.text
    assert_documented_shape(answer.json(), SPECULATIVE_COMPLETION)
    assert answer.json()["model"] == "raptor-fast"
    unload(requests, "raptor-fast", "raptor-fast")


def test_E46_continuous_batching_knobs(requests):
    """L669-678: continuous batching with cb_max_num_seqs 256: the model's scheduler capacity in /v1/queue/stats."""
    load(requests, """{
"model_path": "SRSWTI/bodega-raptor-8b-mxfp4",
"model_type": "lm",
"continuous_batching": true,
"cb_max_num_seqs": 256,
"cb_prefill_batch_size": 16,
"cb_completion_batch_size": 32
}""", RAPTOR_ID)
    rows = {row["id"]: row for row in requests.get(f"{BASE_URL}/v1/queue/stats").json()["models"]}
    assert rows[RAPTOR_ID]["max_num_seqs"] == 256
    unload(requests, RAPTOR_ID, RAPTOR_ID)


# L433-487: every field with its documented default (or an example value where the default is null), in the two
# modes the table describes: sequential (continuous_batching false, max_concurrency) and batching (the cb_* knobs).
TABLE_SEQUENTIAL = {
    "model_path": RAPTOR, "model_id": None, "model_type": "lm", "context_length": 32768, "max_concurrency": 1,
    "queue_timeout": 300, "queue_size": 100, "quantize": 8, "config_name": None, "lora_paths": None,
    "lora_scales": None, "disable_auto_resize": False, "enable_auto_tool_choice": False, "tool_call_parser": None,
    "reasoning_parser": None, "trust_remote_code": False, "chat_template_file": None, "continuous_batching": False,
    "draft_model_path": None, "num_draft_tokens": None, "prompt_cache_size": 0,
}
TABLE_BATCHING = {
    "model_path": RAPTOR, "model_id": "table-batching", "continuous_batching": True, "cb_max_num_seqs": 256,
    "cb_prefill_batch_size": 8, "cb_completion_batch_size": 32, "cb_chunked_prefill_tokens": 2048,
    "cb_enable_prefix_cache": True, "enable_auto_tool_choice": True, "tool_call_parser": "qwen3",
    "reasoning_parser": "qwen3", "num_draft_tokens": 4,
}


@pytest.mark.parametrize("body", [TABLE_SEQUENTIAL, TABLE_BATCHING], ids=["sequential", "batching"])
def test_E32_the_field_table_with_its_defaults_is_accepted(requests, body):
    """L433-487: each body loads and serves; context_length, queue_size and cb_max_num_seqs read back as given."""
    model_id = body["model_id"] or RAPTOR_ID
    absent(requests, model_id)
    response = requests.post(f"{BASE_URL}/v1/admin/load-model", json=body)
    assert response.status_code == 200, response.text
    assert response.json() == {**LOAD_ANSWER, "model_id": model_id, "model_path": RAPTOR}
    answer = requests.post(f"{BASE_URL}/v1/chat/completions", json={"model": model_id, "messages": HI})
    assert answer.status_code == 200, answer.text
    row = {r["id"]: r for r in requests.get(f"{BASE_URL}/v1/queue/stats").json()["models"]}[model_id]
    assert row["queue_capacity"] == body.get("queue_size", 100)
    assert row["max_num_seqs"] == body.get("cb_max_num_seqs", 256)
    if "context_length" in body:
        assert loaded_models(requests)[model_id]["context_length"] == body["context_length"]
    unload(requests, model_id, model_id)


@pytest.mark.parametrize("parser", ["glm4_moe", "qwen3_coder", "qwen3_moe", "qwen3_next", "qwen3_vl", "minimax_m2"])
def test_E32_every_documented_parser_name_loads(requests, parser):
    """L483-487: tool_call_parser and reasoning_parser take qwen3, glm4_moe, qwen3_coder, qwen3_moe, qwen3_next,
    qwen3_vl, harmony, minimax_m2 (qwen3 and harmony: E29 and E07)."""
    model_id = f"parser-{parser}"
    absent(requests, model_id)
    response = requests.post(f"{BASE_URL}/v1/admin/load-model", json={
        "model_path": RAPTOR, "model_id": model_id, "tool_call_parser": parser, "reasoning_parser": parser})
    assert response.status_code == 200, response.text
    unload(requests, model_id, model_id)
