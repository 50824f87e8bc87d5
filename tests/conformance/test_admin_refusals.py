"""What Orchard answers to the Bodega docs with no model loaded, and the documented requests it refuses on purpose
or does not serve yet: /health and chat with no models (L810-814, L840-848), the image routes with their documented
bodies and no image model loaded (L334-380), image-model loads of Bodega's own model names (L336-399), and the
load-model fields that are operator settings or have no Orchard meaning (L433-487, L792-799).

Every refusal here happens before anything is downloaded: the Hub stand-in serves the repo the bodies name, and no
file of it may be fetched.
"""

from __future__ import annotations

import pytest

from tests.conformance import docs_snippets
from tests.conformance.bodega_server import BASE_URL, bodega_server, curl_json
from tests.conformance.conftest import RAPTOR
from tests.conformance.docs_shapes import ERROR, HEALTH_NO_MODELS, assert_documented_shape, assert_refused

NOT_SERVED = ("not served",)
OPERATOR_ONLY = ("operator setting",)


@pytest.fixture(scope="module")
def server(lm_folder, tmp_path_factory):
    with bodega_server({RAPTOR: lm_folder}, tmp_path_factory.mktemp("hf-cache")) as running:
        yield running
        assert not running.hub.file_gets(RAPTOR), "a refused load downloaded its repo"


@pytest.fixture
def requests(server):
    return server.requests


def load(requests, body: str):
    return curl_json(requests, "POST", "/v1/admin/load-model", body)


def test_E50_health_with_no_models(requests):
    """L810-814: {"status": "unhealthy", "model_id": null, "model_status": "no_models"}."""
    response = curl_json(requests, "GET", "/health")
    assert_documented_shape(response.json(), HEALTH_NO_MODELS)
    assert {key: response.json()[key] for key in HEALTH_NO_MODELS} == HEALTH_NO_MODELS


def test_E52_chat_with_no_model_loaded_is_503(requests):
    """L840-848: the docs' client prints "No model loaded. Load a model first." on a 503; Orchard's error is typed
    no_models_loaded."""
    body = {"model": "bodega-raptor-8b", "messages": [{"role": "user", "content": "Hello, welcome to the world of "
                                                                                    "dreamers?"}]}
    ran = docs_snippets.run(docs_snippets.handle_errors, requests, body)
    response, _ = ran.value
    assert ran.printed == "No model loaded. Load a model first.\n"
    assert_documented_shape(response.json(), ERROR)
    assert response.json()["error"]["code"] == "no_models_loaded"


def test_E24_E25_image_generation_route_takes_the_documented_body(requests):
    """L352-371: POST /v1/images/generations with the documented body: valid as it stands (size, guidance_scale,
    steps, seed), answered as every model route is with no model loaded: 503 no_models_loaded, naming it."""
    response = curl_json(requests, "POST", "/v1/images/generations", """{
"model": "solomon",
"prompt": "A highly detailed portrait of a tiny red dragon wearing a chef hat, pulling a fresh loaf of sourdough bread out of a medieval stone oven.",
"size": "1024x1024",
"guidance_scale": 3.5,
"steps": 14,
"seed": 42
}""")
    assert response.status_code == 503, response.text
    assert_documented_shape(response.json(), ERROR)
    assert response.json()["error"]["code"] == "no_models_loaded" and "solomon" in response.json()["error"]["message"]


def test_E26_image_edit_route_takes_an_image_and_an_instruction(requests):
    """L371-380: POST /v1/images/edits (the docs show no body for it: an image and an instruction, as OpenAI's edits
    take them), answered as every model route is with no model loaded."""
    response = requests.post(f"{BASE_URL}/v1/images/edits", data={"model": "kalamkari-edit", "prompt": "Make it dusk"},
                             files={"image": ("oven.png", b"\x89PNG\r\n\x1a\n", "image/png")})
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "no_models_loaded"
    assert "kalamkari-edit" in response.json()["error"]["message"]


@pytest.mark.parametrize("body", [
    """{
"model_id": "solomon",
"model_type": "image-generation",
"config_name": "solomon"
}""", """{
"model_id": "keshav",
"model_type": "image-generation",
"config_name": "keshav"
}""", """{
"model_id": "kalamkari-edit",
"model_type": "image-edit",
"config_name": "qwen-image-edit"
}""", """{
"model_path": "srswti/solomon",
"model_type": "image-generation",
"config_name": "solomon",
"quantize": 8
}"""], ids=["E22-solomon", "E23-keshav", "E26-kalamkari-edit", "E28-quantize"])
def test_E22_E23_E26_E28_image_model_loads_of_unknown_families_name_those_served(requests, body):
    """L336-352, L373-380, L392-399: Bodega's config names stand for models it does not publish (solomon, keshav), or
    for families not served here yet (qwen-image-edit): a 400 naming config_name and the families this server runs."""
    assert_refused(load(requests, body), 400, "config_name", ("this server runs flux2-klein",))


def test_E49_chat_template_file_is_an_operator_setting(requests):
    """L792-799: refused on purpose over HTTP: the server would read a file the caller names (its contents end up in
    prompts and template errors); serve_config.yaml, the operator's file, still takes it."""
    response = load(requests, """{
"model_path": "SRSWTI/bodega-raptor-8b-mxfp4",
"model_type": "lm",
"chat_template_file": "/path/to/custom_template.jinja"
}""")
    assert_refused(response, 400, "chat_template_file", OPERATOR_ONLY)


def test_E32_E58_trust_remote_code_true_is_an_operator_setting(requests):
    """L465-466, L873: refused on purpose over HTTP: with load-by-repo-id it would run the Python of any repo a
    caller names; false (the default) is accepted (test_admin_load_model.py)."""
    response = requests.post(f"{BASE_URL}/v1/admin/load-model", json={
        "model_path": RAPTOR, "model_type": "lm", "trust_remote_code": True})
    assert_refused(response, 400, "trust_remote_code", OPERATOR_ONLY)


@pytest.mark.parametrize("field, value, because", [
    ("config_name", "solomon", ("image",)),
    ("disable_auto_resize", True, NOT_SERVED),
], ids=["config_name", "disable_auto_resize-true"])
def test_E32_fields_without_an_orchard_meaning_are_refused_saying_why(requests, field, value, because):
    """L433-487: config_name (image models), disable_auto_resize true: a 400 that names the field and says why, never
    a silent reinterpretation."""
    response = requests.post(f"{BASE_URL}/v1/admin/load-model", json={"model_path": RAPTOR, field: value})
    assert_refused(response, 400, field, because)


@pytest.mark.parametrize("fields, because", [
    ({"lora_paths": ["/adapters/raptor-lora"]}, ("outside the allowed model_roots",)),
    ({"lora_paths": ["/adapters/a", "/adapters/b"], "lora_scales": [1.0]}, ("2 lora_paths",)),
], ids=["lora_paths-outside-roots", "lora_scales-unpaired"])
def test_E32_lora_paths_follow_the_model_folder_rules(requests, fields, because):
    """L453-456: lora_paths (adapters fused at load, lora_scales one per path) are folders under model_roots, as a
    model's; a scale list that does not pair with the paths is refused naming it."""
    response = requests.post(f"{BASE_URL}/v1/admin/load-model", json={"model_path": RAPTOR, **fields})
    assert_refused(response, 400, next(iter(fields)) if len(fields) == 1 else "lora_scales", because)


def test_E32_model_path_is_required(requests):
    """L435: model_path is required."""
    response = requests.post(f"{BASE_URL}/v1/admin/load-model", json={"model_id": "bodega-raptor-8b"})
    assert_refused(response, 400, "model_path", ("required",))


def test_E03_a_load_of_a_repo_the_hub_does_not_have_answers_the_error(requests):
    """L33-41 with a repo id the Hub does not know: the load waits for its outcome (L381) and answers the failure,
    typed and naming the repo, rather than "loaded" or a "loading" that later fails unseen."""
    response = requests.post(f"{BASE_URL}/v1/admin/load-model", json={
        "model_path": "SRSWTI/bodega-raptor-404b", "model_id": "bodega-raptor-404b", "model_type": "lm"})
    assert 400 <= response.status_code < 500, response.text
    assert_documented_shape(response.json(), ERROR)
    assert "SRSWTI/bodega-raptor-404b" in response.json()["error"]["message"]
