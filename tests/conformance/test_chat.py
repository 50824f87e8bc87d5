"""Bodega docs, "Core Endpoints" chat examples (L156-333), reasoning and JSON mode (L568-600), and the monitoring
routes (L499-530, L799-818), replayed against one server with the two models those examples name: raptor as the
quick start loads it (L33-41) and solomon as the docs' config.yaml entry loads it (L119-123, as a load body).

The scripted raptor (tests/support/scripted_models.py) is a Qwen3-style thinking model (thinking on unless
enable_thinking is false) that writes "<think>Hm</think>OK". So every answer is known: reasoning "Hm", content "OK";
and JSON grammars close each string at once.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.conformance import docs_snippets
from tests.conformance.bodega_server import absent, bodega_server, curl_json, ensure_loaded
from tests.conformance.conftest import RAPTOR, REASONING_DISTILL, SOLOMON
from tests.conformance.docs_shapes import (
    CHAT_COMPLETION, HEALTH_WITH_MODELS, LOAD_ANSWER, LOADED_MODELS, assert_documented_shape,
)
from tests.support.vlm_images import png_bytes

CHAT_URL = "http://localhost:44468/v1/chat/completions"
RAPTOR_QUICK_START = {"model_path": RAPTOR, "model_id": "bodega-raptor-8b", "model_type": "lm",
                      "context_length": 32768, "prompt_cache_size": 10}  # L35-41
SOLOMON_CONFIG_ENTRY = {"model_id": "bodega-solomon-9b", "model_type": "multimodal", "model_path": SOLOMON,
                        "max_concurrency": 1}  # L120-123 (config.yaml's entry, the fields of a load body)


@pytest.fixture(scope="module")
def requests(lm_folder, vlm_folder, prompt_opens_think_lm_folder, tmp_path_factory):
    repos = {RAPTOR: lm_folder, SOLOMON: vlm_folder, REASONING_DISTILL: prompt_opens_think_lm_folder}
    with bodega_server(repos, tmp_path_factory.mktemp("hf-cache")) as server:
        for body in (RAPTOR_QUICK_START, SOLOMON_CONFIG_ENTRY):
            ensure_loaded(server.requests, body)
        yield server.requests


def test_E13_E17_system_and_user_messages_answer_the_documented_completion(requests):
    """L156-167 (request) and L225-245 (response)."""
    response = curl_json(requests, "POST", "/v1/chat/completions", """{
"model": "bodega-raptor-8b",
"messages": [
{"role": "system", "content": "You are a helpful assistant."},
{"role": "user", "content": "What is machine learning?"}
],
"max_tokens": 1000,
"temperature": 0.7
}""")
    assert response.status_code == 200, response.text
    body = response.json()
    assert_documented_shape(body, CHAT_COMPLETION)
    assert (body["object"], body["model"], body["choices"][0]["message"]["role"]) == (
        "chat.completion", "bodega-raptor-8b", "assistant")
    assert (body["choices"][0]["message"]["content"], body["choices"][0]["finish_reason"]) == ("OK", "stop")
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_E14_E15_stream_read_by_the_docs_parser(requests):
    """L167-175 (curl, stream: true) and L175-197 (the Python SSE loop): every data line parses, the stream ends
    with data: [DONE], and the printed text is the answer's content."""
    curl = curl_json(requests, "POST", "/v1/chat/completions", """{
"model": "bodega-raptor-8b",
"messages": [
{"role": "user", "content": "Write a short story about AI."}
],
"stream": true
}""")
    assert curl.status_code == 200 and curl.headers["content-type"].startswith("text/event-stream")
    data = [line[6:] for line in curl.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    for chunk in map(json.loads, data[:-1]):
        assert chunk["object"] == "chat.completion.chunk" and "delta" in chunk["choices"][0], chunk

    ran = docs_snippets.run(docs_snippets.stream_story, requests)
    assert ran.value.status_code == 200
    assert ran.printed == "OK"


def test_E16_every_parameter_of_the_table_is_accepted(requests):
    """L197-224: each documented parameter with its documented type (the default where one is given): model,
    messages, max_tokens, temperature, top_p, stream, tools, tool_choice, response_format, presence_penalty,
    frequency_penalty, stop (string and array), seed; temperature's whole documented range 0.0-2.0."""
    weather_tool = {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    table = {"model": "bodega-raptor-8b", "messages": [{"role": "user", "content": "What is machine learning?"}],
             "max_tokens": None, "temperature": 0.7, "top_p": 1.0, "stream": False, "tools": [weather_tool],
             "tool_choice": "auto", "response_format": None, "presence_penalty": 0.0, "frequency_penalty": 0.0,
             "stop": None, "seed": 42}
    variants = [table, {**table, "stop": "\n\n", "tools": None, "tool_choice": None},
                {**table, "stop": ["\n\n", "END"]}, {**table, "temperature": 0.0}, {**table, "temperature": 2.0}]
    for body in variants:
        response = requests.post(CHAT_URL, json=body)
        assert response.status_code == 200, (body, response.text)
        assert_documented_shape(response.json(), CHAT_COMPLETION)
    # tool_choice as an object (L214: "string/object"): the named function is called (content null, as OpenAI).
    forced = requests.post(CHAT_URL, json={**table, "tool_choice": {"type": "function", "function": {
        "name": "get_weather"}}})
    assert forced.status_code == 200, forced.text
    assert forced.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_E18_json_schema_address_extractor(requests):
    """L245-283: response_format json_schema (AddressExtractor), not streamed; the docs print message.content,
    the JSON document (L280: '{"address": {...}}')."""
    ran = docs_snippets.run(docs_snippets.extract_address, requests, False)
    assert ran.value.status_code == 200, ran.value.text
    content = ran.value.json()["choices"][0]["message"]["content"]
    assert content, ran.value.json()["choices"][0]["message"]  # not all of it taken for reasoning
    jsonschema.validate(json.loads(content), docs_snippets.ADDRESS_SCHEMA["json_schema"]["schema"])
    assert ran.printed == content + "\n"


def test_E19_json_schema_streamed(requests):
    """L283: structured output with "stream": true streams the JSON; the docs' stream loop (L185-196) prints it."""
    ran = docs_snippets.run(docs_snippets.extract_address, requests, True)
    assert ran.value.status_code == 200, ran.value.text
    jsonschema.validate(json.loads(ran.printed), docs_snippets.ADDRESS_SCHEMA["json_schema"]["schema"])


def test_E21_vision_with_a_base64_data_url(requests, tmp_path, monkeypatch):
    """L309-333: the docs read document_scan.png from the working directory and send it as a data URL to the
    multimodal bodega-solomon-9b; the answer is a chat completion (the image counts in its prompt tokens)."""
    (tmp_path / "document_scan.png").write_bytes(png_bytes(112, 84, seed=3))
    monkeypatch.chdir(tmp_path)
    ran = docs_snippets.run(docs_snippets.describe_scan, requests)
    assert ran.value.status_code == 200, ran.value.text
    assert_documented_shape(ran.value.json(), CHAT_COMPLETION)
    assert ran.printed == "OK\n" and ran.value.json()["usage"]["prompt_tokens"] > 20


def test_E39_E40_reasoning_parser_then_enable_thinking(requests):
    """L568-586: a load with reasoning_parser qwen3 answers "loaded"; the chat with chat_template_kwargs
    enable_thinking (to "bodega-raptor-8b", as the docs write it) gives reasoning_content beside content."""
    absent(requests, "bodega-raptor-8b-mxfp4")
    loaded = curl_json(requests, "POST", "/v1/admin/load-model", """{
"model_path": "SRSWTI/bodega-raptor-8b-mxfp4",
"model_type": "lm",
"reasoning_parser": "qwen3"
}""")
    assert loaded.status_code == 200, loaded.text
    assert loaded.json() == {**LOAD_ANSWER, "model_id": "bodega-raptor-8b-mxfp4", "model_path": RAPTOR}
    absent(requests, "bodega-raptor-8b-mxfp4")  # the other examples here expect raptor loaded once

    ran = docs_snippets.run(docs_snippets.think_through_puzzle, requests)
    assert (ran.value["reasoning_content"], ran.value["content"]) == ("Hm", "OK")
    assert ran.printed == "Thinking: Hm\nAnswer: OK\n"


def test_E41_json_object_content_parses(requests):
    """L586-600: response_format json_object; the docs json.loads(message.content)."""
    ran = docs_snippets.run(docs_snippets.three_colors, requests)
    assert isinstance(ran.value, dict)


def test_E18_E41_json_modes_on_a_model_whose_prompt_opens_think(requests):
    """L245-283 and L586-600 (the E18 and E41 bodies, to another model) on a Qwen3-2507-style thinking model, one
    of the reasoning distills the docs list (L830): its template ends the prompt with <think>. A JSON grammar applies
    from the first token, so the model writes no reasoning: the JSON is the answer, and the docs' clients read it
    from message.content."""
    model_id = "bodega-raptor-1b-reasoning-opus4.5-distill"
    ensure_loaded(requests, {"model_path": REASONING_DISTILL, "model_type": "lm", "reasoning_parser": "qwen3"})
    schema = docs_snippets.ADDRESS_SCHEMA
    messages = [
        {"role": "system", "content": "Extract the address from the user input into the specified JSON format."},
        {"role": "user", "content": "Please format this address: 1 Hacker Wy Menlo Park CA 94025"}]
    try:
        for response_format in (schema, {"type": "json_object"}):
            response = requests.post(CHAT_URL, json={"model": model_id, "messages": messages,
                                                     "response_format": response_format})
            assert response.status_code == 200, response.text
            message = response.json()["choices"][0]["message"]
            assert isinstance(json.loads(message["content"] or "null"), dict), message
    finally:
        absent(requests, model_id)  # the module's other examples count the models loaded


def test_E35_loaded_models_with_memory_read_by_the_docs_loop(requests):
    """L499-530: curl and the Python loop (model.get('memory', {}).get('metal_active_mb', 0) ...); every field of
    L509-530, the context_length as loaded."""
    curl = curl_json(requests, "GET", "/v1/admin/loaded-models")
    assert curl.status_code == 200
    body = curl.json()
    assert_documented_shape(body, LOADED_MODELS)
    models = {model["id"]: model for model in body["data"]}
    assert body["total"] == len(body["data"]) and {"bodega-raptor-8b", "bodega-solomon-9b"} <= set(models)
    raptor = models["bodega-raptor-8b"]
    assert (raptor["type"], raptor["model_path"], raptor["context_length"]) == ("lm", RAPTOR, 32768)  # as L513-516
    assert models["bodega-solomon-9b"]["type"] == "multimodal"

    ran = docs_snippets.run(docs_snippets.print_loaded_models, requests)
    assert f"[RUNNING] bodega-raptor-8b — PID: {models['bodega-raptor-8b']['pid']}" in ran.printed
    assert ran.printed.count("Total System Pool:") == len(ran.value)


def test_E50_health_with_models(requests):
    """L799-810: /health while models run: status ok, the ids, "initialized (N model(s))", models_detail."""
    response = curl_json(requests, "GET", "/health")
    assert response.status_code == 200
    body = response.json()
    assert_documented_shape(body, HEALTH_WITH_MODELS)
    ids = {model["id"] for model in body["models_detail"]}
    assert {"bodega-raptor-8b", "bodega-solomon-9b"} <= ids and set(body["model_id"].split(", ")) == ids
    assert body["status"] == "ok" and body["model_status"] == f"initialized ({len(ids)} model(s))"


def test_E51_queue_stats_read_by_the_docs_client(requests):
    """L814-818: curl, and the Python client reading response.json()["queue_stats"]."""
    curl = curl_json(requests, "GET", "/v1/queue/stats")
    assert curl.status_code == 200
    assert_documented_shape(curl.json(), {"queue_stats": {"queue_size": 0, "active_requests": 0}})
    ran = docs_snippets.run(docs_snippets.print_queue_stats, requests)
    assert ran.printed == "Queue size: 0\nActive requests: 0\n"


def test_E52_invalid_parameters_are_400_and_a_good_request_200(requests):
    """L840-848: the docs' status handling; a temperature outside the documented 0.0-2.0 (L207) is a 400 naming it,
    the same body within range is a 200 whose JSON the client keeps."""
    body = {"model": "bodega-raptor-8b", "messages": [{"role": "user", "content": "Hi"}], "temperature": 2.5}
    ran = docs_snippets.run(docs_snippets.handle_errors, requests, body)
    response, result = ran.value
    assert ran.printed == "Invalid request parameters.\n" and result is None
    assert response.json()["error"]["param"] == "temperature"
    ran = docs_snippets.run(docs_snippets.handle_errors, requests, {**body, "temperature": 0.7})
    assert ran.printed == "" and ran.value[1]["object"] == "chat.completion"


def test_E52_a_model_that_is_not_loaded_while_others_are_is_404(requests):
    """L840-848: 503 is "No model loaded" (none at all: test_admin_refusals.py); naming a model this server does
    not have while others run is OpenAI's 404 model_not_found, which the docs' client reports as "Error: 404"."""
    body = {"model": "bodega-raptor-0.9b", "messages": [{"role": "user", "content": "Hi"}]}
    ran = docs_snippets.run(docs_snippets.handle_errors, requests, body)
    assert ran.printed == "Error: 404\n"
    assert ran.value[0].json()["error"]["code"] == "model_not_found"
