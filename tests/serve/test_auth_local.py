"""API keys over the in-process stack, with the real openai and anthropic clients: who may call which route,
401/403 in each API's shape, every configured key compared, and no key in any log line."""

from __future__ import annotations

import asyncio
import hmac
import logging

import anthropic
import httpx2
import openai
import pytest

from deployments.config import ModelConfig
from deployments.ingress import auth
from deployments.ingress.auth import ApiKeys
from tests.serve.local_stack import local_stack

MODEL = "tiny/alpha"
KEYS = ["sk-inference-one", "sk-inference-two"]
ADMIN = "sk-admin-secret"
CHAT = [{"role": "user", "content": "t1 t2"}]
GREEDY = {"max_tokens": 3, "temperature": 0}
MISSING = "Missing API key: send it as 'Authorization: Bearer <key>' or 'x-api-key: <key>'"


@pytest.fixture()
def alpha(tiny_models) -> ModelConfig:
    return ModelConfig(model_id=MODEL, model_path=str(tiny_models.alpha), context_length=512)


def _openai(stack, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://orchard/v1", api_key=key, http_client=stack.http, max_retries=0)


def _anthropic(stack, **credentials) -> anthropic.AsyncAnthropic:
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=stack.app))  # this SDK speaks httpx2
    return anthropic.AsyncAnthropic(base_url="http://orchard", http_client=http, max_retries=0, **credentials)


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_openai_client_with_and_without_a_valid_key(alpha):
    async def scenario():
        async with local_stack([alpha], keys=ApiKeys(KEYS, ADMIN)) as stack:
            answer = await _openai(stack, KEYS[1]).chat.completions.create(model=MODEL, messages=CHAT, **GREEDY)
            assert answer.usage.completion_tokens == 3
            with pytest.raises(openai.AuthenticationError) as refused:
                await _openai(stack, "sk-wrong").chat.completions.create(model=MODEL, messages=CHAT, **GREEDY)
            assert refused.value.status_code == 401
            assert refused.value.response.headers["www-authenticate"] == "Bearer"
            assert refused.value.response.json() == {"error": {
                "message": "Invalid API key", "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}
            missing = await stack.http.post("/v1/completions", json={"model": MODEL, "prompt": "t1", **GREEDY})
            assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
            assert missing.json()["error"] == {
                "message": MISSING, "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}

    asyncio.run(scenario())


def test_anthropic_client_with_x_api_key_or_bearer(alpha):
    async def scenario():
        async with local_stack([alpha], keys=ApiKeys(KEYS, ADMIN)) as stack:
            by_header = await _anthropic(stack, api_key=KEYS[0]).messages.create(model=MODEL, messages=CHAT, max_tokens=3)
            by_bearer = await _anthropic(stack, auth_token=KEYS[1]).messages.create(model=MODEL, messages=CHAT,
                                                                                   max_tokens=3)
            assert by_header.role == by_bearer.role == "assistant"
            assert 1 <= by_header.usage.output_tokens <= 3 and 1 <= by_bearer.usage.output_tokens <= 3
            counted = await _anthropic(stack, api_key=KEYS[0]).messages.count_tokens(model=MODEL, messages=CHAT)
            assert counted.input_tokens > 0
            with pytest.raises(anthropic.AuthenticationError) as refused:
                await _anthropic(stack, api_key="sk-wrong").messages.create(model=MODEL, messages=CHAT, max_tokens=3)
            assert refused.value.status_code == 401
            assert refused.value.response.headers["www-authenticate"] == "Bearer"
            assert refused.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                                     "message": "Invalid API key"}}
            missing = await stack.http.post("/v1/messages/count_tokens", json={"model": MODEL, "messages": CHAT})
            assert missing.status_code == 401
            assert missing.json() == {"type": "error", "error": {"type": "authentication_error", "message": MISSING}}

    asyncio.run(scenario())


def test_admin_key_alone_opens_admin_routes_and_an_inference_key_gets_403():
    async def scenario():
        async with local_stack([], keys=ApiKeys(KEYS, ADMIN)) as stack:
            http = stack.http
            assert (await http.get("/v1/admin/loaded-models")).status_code == 401
            assert (await http.get("/v1/admin/loaded-models", headers=_bearer("sk-wrong"))).status_code == 401
            forbidden = await http.get("/v1/admin/loaded-models", headers={"x-api-key": KEYS[0]})
            assert forbidden.status_code == 403 and "www-authenticate" not in forbidden.headers
            assert forbidden.json()["error"] == {
                "message": "This route needs the admin key; an inference key may not use it",
                "type": "invalid_request_error", "param": None, "code": "insufficient_permissions"}
            unload = await http.delete("/v1/admin/unload-model/nothing", headers=_bearer(KEYS[1]))
            assert unload.status_code == 403
            assert (await http.get("/v1/admin/loaded-models", headers=_bearer(ADMIN))).status_code == 200
            assert (await http.delete("/v1/admin/unload-model/nothing", headers=_bearer(ADMIN))).status_code == 404
            # The admin key opens the inference routes too.
            assert (await http.get("/v1/models", headers={"x-api-key": ADMIN})).status_code == 200

    asyncio.run(scenario())


def test_without_an_admin_key_admin_routes_need_what_inference_routes_need():
    async def scenario():
        async with local_stack([], keys=ApiKeys(KEYS)) as stack:
            http = stack.http
            assert (await http.get("/v1/admin/loaded-models")).status_code == 401
            assert (await http.get("/v1/admin/loaded-models", headers=_bearer(KEYS[0]))).status_code == 200
        async with local_stack([], keys=ApiKeys([], ADMIN)) as stack:  # an admin key only: inference stays open
            http = stack.http
            assert (await http.get("/v1/models")).status_code == 200
            assert (await http.get("/v1/admin/loaded-models")).status_code == 401
            assert (await http.get("/v1/admin/loaded-models", headers=_bearer(ADMIN))).status_code == 200
        async with local_stack([]) as stack:  # no keys: all open, as before
            assert (await stack.http.get("/v1/admin/loaded-models")).status_code == 200

    asyncio.run(scenario())


def test_health_ready_and_docs_stay_open_every_other_route_needs_a_key():
    async def scenario():
        async with local_stack([], keys=ApiKeys(KEYS, ADMIN)) as stack:
            http = stack.http
            assert (await http.get("/health")).status_code == 503  # no model: unhealthy, but answered
            assert (await http.get("/ready")).status_code == 503  # likewise: not ready, but answered without a key
            assert (await http.get("/openapi.json")).status_code == 200
            for path in ("/v1/models", "/v1/models/x", "/v1/queue/stats", "/no/such/route"):
                assert (await http.get(path)).status_code == 401, path
            assert (await http.get("/v1/queue/stats", headers=_bearer(KEYS[0]))).status_code == 200
            assert (await http.get("/no/such/route", headers=_bearer(KEYS[0]))).status_code == 404
            # Basic credentials or an empty Bearer are no key.
            assert (await http.get("/v1/models", headers={"Authorization": f"Basic {KEYS[0]}"})).status_code == 401
            assert (await http.get("/v1/models", headers={"Authorization": "Bearer "})).status_code == 401

    asyncio.run(scenario())


def test_every_configured_key_is_compared_in_constant_time(monkeypatch):
    compared: list[tuple[bytes, bytes]] = []
    real_compare_digest = hmac.compare_digest

    def recording_compare_digest(a, b):
        compared.append((a, b))
        return real_compare_digest(a, b)

    keys = ApiKeys(["k-one", "k-two", "k-three"], ADMIN)
    monkeypatch.setattr(auth.hmac, "compare_digest", recording_compare_digest)  # a spy: the real compare answers
    keys.authorize(auth.RouteAccess.INFERENCE, [b"k-one"])  # matches the first key, yet all four are compared
    assert len(compared) == 4 and all(len(a) == len(b) == 32 for a, b in compared)  # equal-length digests
    compared.clear()
    with pytest.raises(auth.AuthenticationError):
        keys.authorize(auth.RouteAccess.ADMIN, [b"k-nope"])
    assert len(compared) == 1 + 3  # the admin key, then every inference key (a 403 or a 401?)


def test_no_key_appears_in_logs_reprs_or_errors(alpha, caplog):
    caplog.set_level(logging.DEBUG)
    wrong = "sk-presented-but-wrong"

    async def scenario():
        async with local_stack([alpha], keys=ApiKeys(KEYS, ADMIN)) as stack:
            http = stack.http
            for headers in ({}, _bearer(wrong), {"x-api-key": wrong}, _bearer(KEYS[0]), _bearer(ADMIN)):
                await http.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, **GREEDY},
                                headers=headers)
                await http.get("/v1/admin/loaded-models", headers=headers)
                await http.post("/v1/messages", json={"model": MODEL, "messages": CHAT, **GREEDY}, headers=headers)
            return repr(stack)

    stack_repr = asyncio.run(scenario())
    assert "-> invalid_api_key" in caplog.text and "-> insufficient_permissions" in caplog.text  # refusals logged
    for secret in (*KEYS, ADMIN, wrong):
        assert secret not in caplog.text and secret not in stack_repr
    assert repr(ApiKeys(KEYS, ADMIN)) == "ApiKeys(2 inference key(s), admin key set)"
