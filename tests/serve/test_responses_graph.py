"""The Responses API on the real graph (serve_config.yaml on Ray Serve): a Codex-style two-turn tool loop, both
turns streamed by the official `openai` client, the second continuing the first through previous_response_id, so
the stored response lives in the ingress replica while the model runs in its own.

A tiny random model speaks SmolLM2's tokenizer with a Qwen3 tool template: the call is forced (tool_choice
required: constrained decoding) and the answer follows a JSON schema, so both turns end on their own.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
import yaml

from deployments.config import serve_app_name
from tests.serve.conftest import GRAPH_START_S, deploy_graph, model_running, wait_until
from tests.serve.test_responses_local import MODEL, WEATHER
from tests.support.tiny_models import write_smollm2_tokenizer_model

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "tests" / "support" / "qwen3_tools.jinja"
TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER,
          "strict": False}, {"type": "web_search", "external_web_access": False}]  # Codex's default web_search
ANSWER = {"type": "object", "properties": {"sky": {"type": "string", "enum": ["sunny", "rainy"]}},
          "required": ["sky"], "additionalProperties": False}


@pytest.fixture(scope="module")
def base_url(serve_cluster, tmp_path_factory) -> str:
    from ray.serve.schema import ServeDeploySchema

    root = tmp_path_factory.mktemp("responses-graph")
    model_path = write_smollm2_tokenizer_model(root / "model", {"max_position_embeddings": 4096}, seed=1, scale=3.0)
    config = yaml.safe_load((REPO / "serve_config.yaml").read_text())
    ingress, model_app, *_ = config["applications"]  # the chat model's entry is the template
    ingress["args"].update(state_dir=str(root / "state"), status_poll_interval_s=0.5, responses_store_size=10,
                           responses_store_ttl_s=600)
    model_app = copy.deepcopy(model_app)
    model_app["name"] = serve_app_name(MODEL)
    model_app["args"].update(model_id=MODEL, model_path=str(model_path), context_length=1536,
                             chat_template_file=str(TEMPLATE))
    deploy_graph(ServeDeploySchema.model_validate({"applications": [ingress, model_app]}))
    with httpx.Client(base_url=serve_cluster.base_url, timeout=60) as http:
        wait_until(lambda: model_running(http, MODEL), GRAPH_START_S, what=f"{MODEL} running")
    return serve_cluster.base_url


def _streamed_turn(client: openai.OpenAI, **request):
    """One streamed turn: the event types in order, with contiguous sequence numbers, and the final Response."""
    with client.responses.stream(model=MODEL, temperature=0, tools=TOOLS, **request) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert all(getattr(e, "response", final).id == final.id for e in events)
    return [e.type for e in events], final


def test_streamed_two_turn_tool_loop_with_previous_response_id(base_url):
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    kinds, first = _streamed_turn(client, input="What is the weather in Paris?", tool_choice="required",
                                  max_output_tokens=80)
    deltas = kinds.count("response.function_call_arguments.delta")
    assert deltas >= 1 and kinds == [
        "response.created", "response.in_progress", "response.output_item.added",
        *["response.function_call_arguments.delta"] * deltas, "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    assert first.status == "completed" and [t.name for t in first.tools] == ["get_weather"]
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)

    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 18, "sky": "sunny"}'}
    kinds, second = _streamed_turn(client, previous_response_id=first.id, input=[result], reasoning={"effort": "none"},
                                   text={"format": {"type": "json_schema", "name": "answer", "schema": ANSWER,
                                                    "strict": True}}, max_output_tokens=40)
    texts = kinds.count("response.output_text.delta")
    assert texts >= 1 and kinds == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * texts, "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    assert second.status == "completed" and second.previous_response_id == first.id
    jsonschema.validate(json.loads(second.output_text), ANSWER)
    # The first turn's prompt and call came from the ingress's store, and their prefix from the model's cache.
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0

    stored = client.responses.retrieve(second.id)
    assert stored.output_text == second.output_text and stored.previous_response_id == first.id
    client.responses.delete(first.id)
    with pytest.raises(openai.BadRequestError) as gone:  # the chain of `second` lost its first turn
        client.responses.create(model=MODEL, previous_response_id=second.id, input="And tomorrow?")
    assert gone.value.body["code"] == "previous_response_not_found"
