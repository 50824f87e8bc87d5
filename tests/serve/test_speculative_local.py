"""Speculative decoding over HTTP, in-process on tiny models (issue 30, points 3 and 4): per-model config, the
per-request switch `speculative`, the draft tokens a request verified in its usage, the model's counters in
/v1/queue/stats."""

from __future__ import annotations

import asyncio

import pytest
from openai.types.chat import ChatCompletion

from deployments.config import ModelConfig
from tests.serve.local_stack import local_stack, wait_for
from tests.serve.test_ingress_local import sse_payloads

NGRAM = "tiny/ngram"
PLAIN = "tiny/plain"
# A prompt that repeats itself, and a model that repeats itself: n-gram lookup finds drafts.
REPEATING = " ".join(["t1 t2 t3 t4 t5 t6 t7 t8"] * 6)


@pytest.fixture()
def ngram_and_plain(tiny_models) -> list[ModelConfig]:
    """The same weights twice: speculating by n-gram lookup, and not."""
    ngram = ModelConfig(model_id=NGRAM, model_path=str(tiny_models.alpha), context_length=512,
                        speculative={"method": "ngram", "num_draft_tokens": 4, "min_match": 1, "max_match": 3,
                                     "adaptive": False})  # drafts whenever it may: counts not timing-dependent
    return [ngram, ModelConfig(model_id=PLAIN, model_path=str(tiny_models.alpha), context_length=512)]


def chat_body(model: str = NGRAM, **fields) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": REPEATING}], "temperature": 0,
            "max_tokens": 24, "ignore_eos": True, **fields}


async def _speculation(stack, model_id: str) -> dict | None:
    rows = (await stack.http.get("/v1/queue/stats")).json()["models"]
    return next(row for row in rows if row["id"] == model_id)["speculation"]


async def _chat(stack, **fields) -> dict:
    response = await stack.http.post("/v1/chat/completions", json=chat_body(**fields))
    assert response.status_code == 200, response.text
    return response.json()


def test_ngram_drafts_show_in_usage_and_queue_stats_and_change_no_token(ngram_and_plain):
    async def scenario():
        async with local_stack(ngram_and_plain) as stack:
            before = await _speculation(stack, NGRAM)
            speculated = await _chat(stack)
            plain = await _chat(stack, model=PLAIN)
            return before, speculated, plain, await _speculation(stack, NGRAM), await _speculation(stack, PLAIN)

    before, speculated, plain, after, plain_stats = asyncio.run(scenario())
    assert before == {"method": "ngram", "verify_steps": 0, "drafted_tokens": 0, "accepted_tokens": 0,
                      "acceptance_rate": None, "verify_overhead": None}
    assert speculated["choices"][0]["message"] == plain["choices"][0]["message"]
    details = ChatCompletion.model_validate(speculated).usage.completion_tokens_details
    accepted, rejected = details.accepted_prediction_tokens, details.rejected_prediction_tokens
    assert accepted + rejected > 0 and speculated["usage"]["completion_tokens"] == 24
    assert after["method"] == "ngram" and after["verify_steps"] >= 1
    assert (after["drafted_tokens"], after["accepted_tokens"]) == (accepted + rejected, accepted)
    assert after["acceptance_rate"] == round(accepted / (accepted + rejected), 4)
    assert "completion_tokens_details" not in plain["usage"] and plain_stats is None


def test_speculative_false_decodes_plainly_and_a_stream_reports_the_same_usage(ngram_and_plain):
    stream_fields = {"stream": True, "stream_options": {"include_usage": True}}

    async def scenario():
        async with local_stack(ngram_and_plain) as stack:
            opted_out = await _chat(stack, speculative=False)
            untouched = await _speculation(stack, NGRAM)
            whole = await _chat(stack)
            streamed = await stack.http.post("/v1/chat/completions", json=chat_body(**stream_fields))
            return opted_out, untouched, whole, streamed

    opted_out, untouched, whole, streamed = asyncio.run(scenario())
    assert "completion_tokens_details" not in opted_out["usage"]
    assert (untouched["verify_steps"], untouched["drafted_tokens"]) == (0, 0)
    assert opted_out["choices"][0]["message"] == whole["choices"][0]["message"]
    payloads, done = sse_payloads(streamed.text)
    assert done and payloads[-1]["usage"] == whole["usage"]
    assert sum(whole["usage"]["completion_tokens_details"].values()) > 0


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", chat_body(max_tokens=3)),
    ("/v1/completions", {"model": NGRAM, "prompt": "t1 t2", "max_tokens": 3}),
    ("/v1/messages", {"model": NGRAM, "messages": [{"role": "user", "content": "t1"}], "max_tokens": 3}),
    ("/v1/responses", {"model": NGRAM, "input": "t1", "max_output_tokens": 3, "store": False}),
])
def test_the_request_field_is_a_strict_boolean_on_every_generation_route(ngram_and_plain, path, body):
    async def scenario():
        async with local_stack(ngram_and_plain) as stack:
            accepted = [await stack.http.post(path, json={**body, "speculative": value}) for value in (False, True, None)]
            refused = [await stack.http.post(path, json={**body, "speculative": value}) for value in ("no", "false", 0)]
            return accepted, refused, await _speculation(stack, NGRAM)

    accepted, refused, stats = asyncio.run(scenario())
    for answer in accepted:
        assert answer.status_code == 200, answer.text
    for answer in refused:
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert error["message"] == "Invalid request: speculative: Input should be a valid boolean"
        assert path == "/v1/messages" or error["param"] == "speculative"  # Anthropic's bodies have no param
    assert stats["method"] == "ngram"


def test_a_draft_model_config_speculates_with_the_draft(tiny_models):
    """A draft model loads beside the model (Bodega's draft_model_path + num_draft_tokens mean the same config:
    test_config.py); a model drafting for itself has every greedy draft accepted. Not adaptive: it drafts
    whenever it may, whatever this machine's step times."""
    self_draft = ModelConfig.model_validate({"model_id": "tiny/self", "model_path": str(tiny_models.alpha), "speculative": {
        "draft_model_path": str(tiny_models.alpha), "num_draft_tokens": 3, "adaptive": False}})
    plain = ModelConfig(model_id=PLAIN, model_path=str(tiny_models.alpha))

    async def scenario():
        async with local_stack([self_draft, plain]) as stack:
            drafted = await _chat(stack, model="tiny/self", max_tokens=21)
            undrafted = await _chat(stack, model=PLAIN, max_tokens=21)
            return drafted, undrafted, await _speculation(stack, "tiny/self")

    drafted, undrafted, stats = asyncio.run(scenario())
    assert drafted["choices"][0]["message"] == undrafted["choices"][0]["message"]
    details = drafted["usage"]["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] > 0 and details["rejected_prediction_tokens"] == 0
    assert stats["method"] == "draft" and stats["acceptance_rate"] == 1.0
    assert stats["drafted_tokens"] == stats["accepted_tokens"] == details["accepted_prediction_tokens"]


def test_admin_loads_check_the_draft_path_and_the_model_type(tiny_models, tmp_path):
    roots = [str(tiny_models.alpha)]  # the draft (beta) lies outside

    async def scenario():
        async with local_stack([], tmp_path, model_roots=roots) as stack:
            load = {"model_id": "spec", "model_path": str(tiny_models.alpha)}
            outside = await stack.http.post("/v1/admin/load-model", json={**load, "draft_model_path": str(tiny_models.beta)})
            embedding = await stack.http.post("/v1/admin/load-model", json={
                "model_path": "default-embedding", "speculative": {"method": "ngram"}})
            loaded = await stack.http.post("/v1/admin/load-model", json={**load, "speculative": {"num_draft_tokens": 2}})
            await wait_for(lambda: _speculation_when_running(stack, "spec"))
            return outside, embedding, loaded, await _speculation(stack, "spec")

    outside, embedding, loaded, stats = asyncio.run(scenario())
    assert outside.status_code == 400 and outside.json()["error"]["param"] == "speculative.draft_model_path"
    assert outside.json()["error"]["message"] == "'speculative.draft_model_path' lies outside the allowed model_roots"
    assert embedding.status_code == 400 and "applies to model_type 'lm', not 'embedding'" in embedding.text
    assert loaded.status_code == 200, loaded.text
    # Nothing drafted yet; the verify overhead was measured at load (at least the pipeline a verifying step gives up).
    overhead = stats.pop("verify_overhead")
    assert stats == {"method": "ngram", "verify_steps": 0, "drafted_tokens": 0, "accepted_tokens": 0, "acceptance_rate": None}
    assert isinstance(overhead, float) and overhead >= 0.1


async def _speculation_when_running(stack, model_id: str) -> bool:
    rows = (await stack.http.get("/v1/queue/stats")).json()["models"]
    return any(row["id"] == model_id and row["status"] == "running" for row in rows)
