"""The ingress routes over real engines on tiny models, in-process (no Ray): shapes, streams, errors, admin.

Every response is also parsed with the openai SDK's own types, so our shapes stay OpenAI's.
"""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from deployments.config import ModelConfig
from deployments.model_calls import GenerateJob, TextPrompt
from engine.sampling.params import SamplingParams
from tests.serve.local_stack import local_stack, wait_for
from tests.serve.test_metrics_local import Scrape

MODEL = "tiny/alpha"
CHAT = [{"role": "user", "content": "t1 t2 t3"}]


@pytest.fixture()
def alpha(tiny_models) -> ModelConfig:
    return ModelConfig(model_id=MODEL, model_path=str(tiny_models.alpha), context_length=512)


def sse_payloads(text: str) -> tuple[list[dict], bool]:
    """The JSON events of an SSE body, and whether it ended with [DONE]."""
    events = [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]
    done = bool(events) and events[-1] == "[DONE]"
    return [json.loads(e) for e in events if e != "[DONE]"], done


def chat_body(**fields) -> dict:
    return {"model": MODEL, "messages": CHAT, "temperature": 0, "max_tokens": 12, "ignore_eos": True, **fields}


# ---- chat -----------------------------------------------------------------------------------
def test_chat_completion_shape_and_logprobs(alpha):
    async def scenario():
        async with local_stack([alpha]) as stack:
            response = await stack.http.post("/v1/chat/completions", json=chat_body(logprobs=True, top_logprobs=3))
            assert response.status_code == 200, response.text
            return response.json()

    body = asyncio.run(scenario())
    parsed = ChatCompletion.model_validate(body)
    assert parsed.object == "chat.completion" and parsed.model == MODEL and parsed.id.startswith("chatcmpl-")
    choice = parsed.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant" and choice.message.content
    assert parsed.usage.completion_tokens == 12 and parsed.usage.prompt_tokens > 0
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    tokens = choice.logprobs.content
    assert len(tokens) == 12 and "".join(t.token for t in tokens).replace("t", " t").split() == choice.message.content.split()
    for token in tokens:
        assert token.bytes == list(token.token.encode()) and token.logprob <= 0
        assert len(token.top_logprobs) == 3 and token.top_logprobs[0].logprob >= token.top_logprobs[-1].logprob


def test_chat_stream_matches_non_stream_in_openai_order(alpha):
    async def scenario():
        async with local_stack([alpha]) as stack:
            full = (await stack.http.post("/v1/chat/completions", json=chat_body())).json()
            streamed = await stack.http.post(
                "/v1/chat/completions", json=chat_body(stream=True, stream_options={"include_usage": True})
            )
            return full, streamed

    full, streamed = asyncio.run(scenario())
    assert streamed.headers["content-type"].startswith("text/event-stream")
    payloads, done = sse_payloads(streamed.text)
    assert done
    chunks = [ChatCompletionChunk.model_validate(p) for p in payloads]
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full["choices"][0]["message"]["content"]
    finish_chunk, usage_chunk = payloads[-2], payloads[-1]
    assert finish_chunk["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == full["usage"]
    assert all("usage" in p and p["usage"] is None for p in payloads[:-1])
    assert len({p["id"] for p in payloads}) == 1


def test_stream_without_include_usage_has_no_usage_key(alpha):
    async def scenario():
        async with local_stack([alpha]) as stack:
            return await stack.http.post("/v1/chat/completions", json=chat_body(stream=True))

    payloads, done = sse_payloads(asyncio.run(scenario()).text)
    assert done and all("usage" not in p for p in payloads)


def test_stop_string_and_text_parts(alpha):
    async def scenario():
        async with local_stack([alpha]) as stack:
            plain = (await stack.http.post("/v1/chat/completions", json=chat_body())).json()
            words = plain["choices"][0]["message"]["content"].split()
            stop_word = next(w for w in words[2:] if w not in words[:2])
            stopped = (await stack.http.post("/v1/chat/completions", json=chat_body(stop=[stop_word]))).json()
            parts = [{"role": "user", "content": [{"type": "text", "text": "t1 t2 t3"}]}]
            from_parts = (await stack.http.post("/v1/chat/completions", json=chat_body(messages=parts))).json()
            return plain, stop_word, stopped, from_parts

    plain, stop_word, stopped, from_parts = asyncio.run(scenario())
    text = stopped["choices"][0]["message"]["content"]
    assert stopped["choices"][0]["finish_reason"] == "stop" and stop_word not in text
    assert plain["choices"][0]["message"]["content"].startswith(text.rstrip())
    assert from_parts["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]


# ---- completions --------------------------------------------------------------------------
def test_completions_full_and_streamed_with_logprobs(alpha):
    body = {"model": MODEL, "prompt": "t4 t5", "max_tokens": 10, "temperature": 0, "ignore_eos": True, "logprobs": 2}

    async def scenario():
        async with local_stack([alpha]) as stack:
            full = (await stack.http.post("/v1/completions", json=body)).json()
            streamed = await stack.http.post(
                "/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}
            )
            return full, streamed.text

    full, streamed = asyncio.run(scenario())
    parsed = Completion.model_validate(full)
    assert parsed.object == "text_completion" and parsed.choices[0].finish_reason == "length"
    logprobs = parsed.choices[0].logprobs
    assert len(logprobs.tokens) == 10 and len(logprobs.token_logprobs) == 10
    assert all(len(top) <= 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset == sorted(logprobs.text_offset) and logprobs.text_offset[0] == 0
    payloads, done = sse_payloads(streamed)
    assert done
    # The SDK types finish_reason as non-null, yet OpenAI streams null until the last chunk (as we do).
    for payload in payloads:
        assert set(payload) == {"id", "object", "created", "model", "choices", "usage"}
        assert all(set(c) == {"index", "text", "logprobs", "finish_reason"} for c in payload["choices"])
    chunks = [p["choices"][0] for p in payloads if p["choices"]]
    Completion.model_validate(next(p for p in payloads if p["choices"] and p["choices"][0]["finish_reason"]))
    assert "".join(c["text"] for c in chunks) == parsed.choices[0].text
    offsets = [o for c in chunks if c["logprobs"] for o in c["logprobs"]["text_offset"]]
    assert offsets == logprobs.text_offset  # offsets continue across chunks
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == 10


def test_completion_prompt_as_token_ids(alpha):
    async def scenario():
        async with local_stack([alpha]) as stack:
            return (await stack.http.post("/v1/completions", json={"model": MODEL, "prompt": [4, 5, 6], "max_tokens": 3})).json()

    body = asyncio.run(scenario())
    assert body["usage"]["prompt_tokens"] == 3 and body["usage"]["completion_tokens"] <= 3


# ---- errors --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "fields, status, param, code",
    [
        ({"model": "missing"}, 404, "model", "model_not_found"),
        ({"n": 2}, 400, "n", None),
        ({"temperature": 3}, 400, "temperature", None),
        ({"functions": [{"name": "f"}]}, 400, "functions", None),  # unknown fields are ignored; this one is not
        ({"modalities": ["text", "audio"]}, 400, "modalities", None),
        ({"modalities": 5}, 400, "modalities", None),
        ({"response_format": {"type": "json_object"}}, 400, "response_format", None),
        ({"response_format": {"type": "yaml"}}, 400, "response_format.type", None),
        ({"top_logprobs": 2}, 400, "top_logprobs", None),
        ({"stream_options": {"include_usage": True}}, 400, "stream_options", None),
        ({"max_tokens": 600}, 400, "max_tokens", "context_length_exceeded"),
        ({"messages": [{"role": "user", "content": "t1 " * 600}]}, 400, "messages", "context_length_exceeded"),
        # An image URL without a scheme: refused by the ingress, naming the part (issue 27).
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages.0.content.0", None),
        ({"messages": []}, 400, "messages", None),
        ({"logit_bias": {"9999": 1}}, 400, "logit_bias", None),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, 400, "tools.0.function.name", None),
    ],
)
def test_errors_have_openai_bodies(alpha, fields, status, param, code):
    async def scenario():
        async with local_stack([alpha]) as stack:
            return await stack.http.post("/v1/chat/completions", json=chat_body(**fields))

    response = asyncio.run(scenario())
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["code"] == code


def test_tools_are_accepted_and_shape_checked(alpha):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]

    async def scenario():
        async with local_stack([alpha]) as stack:
            return await stack.http.post("/v1/chat/completions", json=chat_body(tools=tools, tool_choice="auto"))

    assert asyncio.run(scenario()).status_code == 200


def test_queue_full_is_429_with_retry_after(tiny_models):
    config = ModelConfig(model_id=MODEL, model_path=str(tiny_models.alpha), cb_max_num_seqs=1)

    async def scenario():
        async with local_stack([config]) as stack:
            client = await stack.registry.route(MODEL)
            job = GenerateJob("held", TextPrompt(text="t1"), SamplingParams(max_tokens=60000, ignore_eos=True), stream=True)
            held = client.generate(job)
            await anext(held)  # admitted and generating
            try:
                return await stack.http.post("/v1/chat/completions", json=chat_body())
            finally:
                await held.aclose()

    response = asyncio.run(scenario())
    assert response.status_code == 429 and response.headers["retry-after"] == "1"
    assert response.json()["error"]["type"] == "rate_limit_error" and response.json()["error"]["code"] == "queue_full"


def test_closing_a_stream_aborts_it_and_frees_its_kv(alpha):
    async def scenario():
        async with local_stack([alpha]) as stack:
            client = await stack.registry.route(MODEL)
            job = GenerateJob("gone", TextPrompt(text="t1"), SamplingParams(max_tokens=500, ignore_eos=True), stream=True)
            chunks = client.generate(job)
            await anext(chunks)
            await chunks.aclose()  # what a client disconnect does
            stats = await wait_for(
                lambda: _idle_stats(stack), timeout_s=5
            )
            return stats

    stats = asyncio.run(scenario())
    assert stats["running"] == 0 and stats["kv_cache_bytes"] == 0 and stats["generation_tokens_total"] < 500
    assert stats["engine_steps_total"] >= 1 and stats["engine_step_seconds_total"] > 0
    assert stats["process_cpu_seconds_total"] >= stats["engine_step_cpu_seconds_total"] > 0


async def _idle_stats(stack) -> dict | None:
    """The model's stats once idle after work: the start-up stats (no step yet) are idle too, and a first
    token now leaves before the stats of its step, so a quick abort could otherwise read those."""
    row = (await stack.http.get("/v1/queue/stats")).json()["models"][0]
    return row if row["running"] == 0 and row["kv_cache_bytes"] == 0 and row["engine_steps_total"] >= 1 else None


# ---- request ids ---------------------------------------------------------------------------------
def test_request_id_reaches_the_log_lines(alpha):
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("ray.serve.orchard")
    logger.addHandler(handler)
    previous_level = logger.level
    logger.setLevel(logging.INFO)  # setLevel, not .level: it clears the cached level an earlier test left

    async def scenario():
        async with local_stack([alpha]) as stack:
            given = await stack.http.post("/v1/chat/completions", json=chat_body(), headers={"X-Request-Id": "req-77"})
            generated = await stack.http.get("/v1/models")
            return given, generated

    try:
        given, generated = asyncio.run(scenario())
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous_level)
    assert given.status_code == 200 and len(generated.headers["x-request-id"]) == 32
    lines = [r.getMessage() for r in records]
    assert any("req-77" in line and "started" in line for line in lines)
    assert any("req-77" in line and "finished" in line for line in lines)


def test_bodegas_image_routes_take_the_documented_body_and_name_a_model_not_loaded(alpha):
    """Bodega's documented image requests are valid here; with no such model loaded the answer is the typed 404."""
    documented = {"model": "solomon", "prompt": "A tiny red dragon", "size": "1024x1024", "guidance_scale": 3.5,
                  "steps": 14, "seed": 42}

    async def scenario():
        async with local_stack([alpha]) as stack:
            return [await stack.http.post("/v1/images/generations", json=documented),
                    await stack.http.post("/v1/images/edits", data=documented | {"model": "kalamkari"},
                                          files={"image": ("a.png", b"png", "image/png")})]

    for model, answer in zip(("solomon", "kalamkari"), asyncio.run(scenario())):
        assert answer.status_code == 404, answer.text
        assert model in answer.json()["error"]["message"]

def test_bodies_pydantic_cannot_read_get_the_standard_librarys_answer(alpha):
    """The generation routes read JSON with pydantic_core (ingress/json_body.py); what it refuses goes to json.loads:
    a lone surrogate escape still parses (and meets the check of the text that names it), bad JSON gets the same
    error body as on a route reading it the usual way."""
    async def scenario():
        async with local_stack([alpha]) as stack:
            surrogate = json.dumps(chat_body(messages=[{"role": "user", "content": "t1 \ud800 t2"}]))
            ok = await stack.http.post("/v1/chat/completions", content=surrogate,
                                       headers={"content-type": "application/json"})
            bad = [await stack.http.post(path, content=b'{"model": "alpha",}', headers={"content-type": "application/json"})
                   for path in ("/v1/chat/completions", "/v1/embeddings")]
            return ok, bad

    ok, (fast, plain) = asyncio.run(scenario())
    assert ok.status_code == 400 and "lone surrogate" in ok.json()["error"]["message"], ok.text
    assert fast.status_code == plain.status_code == 400 and fast.json()["error"]["type"] == "invalid_request_error"
    assert fast.json()["error"]["message"] == plain.json()["error"]["message"]


def test_a_batch_priority_request_gives_its_decode_slot_to_an_interactive_one(alpha):
    """X-Orchard-Priority: batch (what Batches API lines carry) reaches the engine's scheduler: with one decode slot,
    an interactive request sent while a batch one decodes takes its slot (the batch row preempted, resumed by
    recompute after it); both answers equal the same requests sent alone. Another value is refused, naming it."""
    one_slot = alpha.model_copy(update={"max_decode_seqs": 1, "context_length": 4096})
    batch_body = chat_body(max_tokens=1500)
    question = chat_body(max_tokens=5, messages=[{"role": "user", "content": "t7 t8"}])

    async def decoding(http) -> bool | None:
        row = next(m for m in (await http.get("/v1/queue/stats")).json()["models"] if m["id"] == MODEL)
        return True if row["decoding"] == 1 else None

    async def scenario():
        async with local_stack([one_slot]) as stack:
            http = stack.http
            alone = [(await http.post("/v1/chat/completions", json=b)).json() for b in (batch_body, question)]
            batch = asyncio.create_task(http.post("/v1/chat/completions", json=batch_body,
                                                  headers={"X-Orchard-Priority": "batch"}))
            await wait_for(lambda: decoding(http), timeout_s=30)  # its row holds the one slot
            interactive = (await http.post("/v1/chat/completions", json=question)).json()
            batch_done = batch.done()
            batch_answer = (await batch).json()
            refused = await http.post("/v1/chat/completions", json=question, headers={"X-Orchard-Priority": "urgent"})
            scrape = Scrape((await http.get("/metrics")).text)
            preemptions = scrape.values.get(("orchard:num_preemptions_total", (("model_name", MODEL),)))
            return alone, interactive, batch_done, batch_answer, refused, preemptions

    alone, interactive, batch_done, batch_answer, refused, preemptions = asyncio.run(scenario())
    assert preemptions == 1.0 and not batch_done  # answered while the batch request still ran
    assert interactive["choices"][0]["message"]["content"] == alone[1]["choices"][0]["message"]["content"]
    assert batch_answer["choices"][0]["message"]["content"] == alone[0]["choices"][0]["message"]["content"]
    assert batch_answer["usage"] == alone[0]["usage"]
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "X-Orchard-Priority"
