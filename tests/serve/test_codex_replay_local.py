"""Every request Codex CLI 0.169.0 sent to a capturing stand-in (tests/fixtures/agents/codex), replayed with its
headers against the in-process stack on a tiny model with the default model's tokenizer and template (SmolLM2's
ChatML, so its tools go through the generic format): each is streamed 200 in the Responses API's exact event order.
Then Codex's tool loop with Orchard's own answers: the first request with its call forced, and the second built
as Codex builds it, from the items of our response.output_item.done events."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from deployments.config import ModelConfig
from tests.serve.local_stack import local_stack
from tests.serve.test_responses_local import follows_the_grammar, named_events
from tests.support.tiny_models import NARROW_ATTENTION, write_smollm2_tokenizer_model

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "agents" / "codex"
CAPTURED = sorted(FIXTURES.glob("*/*.json"))
MODEL = "tiny/codex"
# Codex sends no max_output_tokens: the model's default_max_tokens applies (a tiny random model would spend 4,096).
DEFAULT_MAX_TOKENS = 6
# Transport headers of the capture, not the request's.
DROPPED_HEADERS = {"host", "content-length", "connection", "accept-encoding", "authorization"}


@pytest.fixture(scope="module")
def chatml(tmp_path_factory) -> ModelConfig:
    folder = write_smollm2_tokenizer_model(tmp_path_factory.mktemp("codex"), NARROW_ATTENTION, seed=2, scale=3.0)
    return ModelConfig(model_id=MODEL, model_path=str(folder), context_length=32768,
                       default_max_tokens=DEFAULT_MAX_TOKENS)


def captured(path: Path) -> tuple[dict[str, str], dict]:
    entry = json.loads(path.read_text())
    assert (entry["method"], entry["path"]) == ("POST", "/v1/responses")
    headers = {k: v for k, v in entry["headers"].items() if k not in DROPPED_HEADERS}
    return headers, {**entry["body"], "model": MODEL}


def test_fixtures_hold_codexs_sequences():
    assert {path.parent.name for path in CAPTURED} == {"hello", "tool_loop", "known_model_reasoning_tool_loop_resume"}
    assert all(json.loads(p.read_text())["headers"]["user-agent"].startswith("codex_exec/0.169.0") for p in CAPTURED)


def assert_streamed_in_order(where: str, answer) -> dict:
    """200, Responses' event grammar, a finished response; returns it."""
    assert answer.status_code == 200, (where, answer.text)
    assert answer.headers["content-type"].startswith("text/event-stream"), where
    events = named_events(answer.text)
    kinds = [e["type"] for e in events]
    assert follows_the_grammar(kinds), (where, kinds)
    final = events[-1]["response"]
    assert final["status"] in ("completed", "incomplete") and final["model"] == MODEL, where
    assert 1 <= final["usage"]["output_tokens"] <= DEFAULT_MAX_TOKENS and final["store"] is False, where
    return final


def test_every_captured_request_streams_in_order(chatml):
    async def scenario():
        async with local_stack([chatml]) as stack:
            before = (await stack.http.get("/v1/queue/stats")).json()["ignored_fields"]
            answers = []
            for path in CAPTURED:
                headers, body = captured(path)
                answers.append(await stack.http.post("/v1/responses", json=body, headers=headers, timeout=120))
            after = (await stack.http.get("/v1/queue/stats")).json()["ignored_fields"]
            # The counts are the process's: other tests in this process count too.
            return answers, {name: count - before.get(name, 0) for name, count in after.items()}

    answers, ignored = asyncio.run(scenario())
    for path, answer in zip(CAPTURED, answers):
        final = assert_streamed_in_order(f"{path.parent.name}/{path.name}", answer)
        offered = {tool["type"] for tool in final["tools"]}
        assert offered <= {"function", "namespace"} and "exec_command" in {t.get("name") for t in final["tools"]}
    # Codex's built-in tools are accepted and not offered to the model: counted, once per request that sent them.
    assert ignored["responses.tool:web_search"] == len(CAPTURED)
    assert ignored["responses.tool:custom"] == ignored["responses.tool:tool_search"] == 3


def test_codexs_tool_loop_with_orchards_own_call(chatml):
    """Turn 1 as Codex sent it, with a call of one of its tools forced (a random model would rarely call on its own;
    get_goal takes no arguments, so the call ends at once); turn 2 as Codex builds it: the first turn's input, then
    the items of our output_item.done events as given, then the tool's output under the call's call_id."""
    first_headers, first = captured(FIXTURES / "tool_loop" / "001_POST_v1_responses.json")
    forced = {**first, "tool_choice": {"type": "function", "name": "get_goal"}}

    async def scenario():
        async with local_stack([chatml.model_copy(update={"default_max_tokens": 40})]) as stack:
            turn1 = await stack.http.post("/v1/responses", json=forced, headers=first_headers, timeout=120)
            items = [e["item"] for e in named_events(turn1.text) if e["type"] == "response.output_item.done"]
            calls = [item for item in items if item["type"] == "function_call"]
            output = {"type": "function_call_output", "id": "fco_1", "call_id": calls[0]["call_id"], "output": "no goal"}
            second = {**first, "input": [*first["input"], *items, output]}
            turn2 = await stack.http.post("/v1/responses", json=second, headers=first_headers, timeout=120)
            return turn1, calls, turn2

    turn1, calls, turn2 = asyncio.run(scenario())
    final = named_events(turn1.text)[-1]["response"]
    assert final["status"] == "completed" and [item["type"] for item in final["output"]] == ["function_call"]
    assert calls[0]["name"] == "get_goal" and json.loads(calls[0]["arguments"]) == {}
    assert turn2.status_code == 200, turn2.text
    last = named_events(turn2.text)[-1]["response"]
    assert last["status"] in ("completed", "incomplete") and last["output"]
    # The history with the call and its output is longer than turn 1's prompt, whose start is read from the cache.
    assert last["usage"]["input_tokens"] > final["usage"]["input_tokens"]
    assert last["usage"]["input_tokens_details"]["cached_tokens"] > 0
