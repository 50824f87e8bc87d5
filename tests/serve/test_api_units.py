"""OpenAI request -> SamplingParams, error mapping, and the renderers' exact shapes (no model)."""

from __future__ import annotations

import asyncio
import json

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from deployments.api.openai_convert import chat_job, completion_job
from deployments.api.errors import wire_error
from deployments.api.openai_render import ChatRenderer, CompletionRenderer, ResponseMeta
from deployments.api.openai_schemas import ChatCompletionRequest, CompletionRequest
from deployments.model_calls import ChatPrompt, StreamChunk, TextPrompt, TokenLogprobInfo, TopTokenLogprob
from engine.errors import (
    ContextLengthExceededError,
    EngineDeadError,
    InvalidRequestError,
    ModelExistsError,
    ModelLoadError,
    ModelLoadingError,
    ModelNotFoundError,
    OrchardError,
    QueueFullError,
    QueueTimeoutError,
)
from engine.output.request_output import Finish, Usage
from engine.request import FinishReason

META = ResponseMeta("chatcmpl-x", 1700000000, "m")


def test_every_sampling_field_reaches_sampling_params():
    body = ChatCompletionRequest.model_validate({
        "model": "m",
        "messages": [
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "u"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
            {"role": "tool", "content": "42", "tool_call_id": "c1"},
        ],
        "temperature": 0.5, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1,
        "presence_penalty": 0.2, "frequency_penalty": -0.3, "logit_bias": {"7": 5}, "seed": 11,
        "stop": "END", "max_completion_tokens": 33, "logprobs": True, "top_logprobs": 4, "n": 1,
        "user": "someone", "stream": True, "stream_options": {"include_usage": True},
        "chat_template_kwargs": {"enable_thinking": False}, "response_format": {"type": "text"},
    })
    job = chat_job(body, "req-1", "log-1")
    s = job.sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p) == (0.5, 0.9, 40, 0.05)
    assert (s.repetition_penalty, s.presence_penalty, s.frequency_penalty) == (1.1, 0.2, -0.3)
    assert s.logit_bias == ((7, 5.0),) and s.seed == 11 and s.stop == ("END",) and s.max_tokens == 33
    assert s.logprobs and s.top_logprobs == 4 and job.stream and job.request_id == "req-1"
    assert isinstance(job.prompt, ChatPrompt) and job.prompt.template_kwargs == {"enable_thinking": False}
    roles = [m["role"] for m in job.prompt.messages]
    assert roles == ["system", "user", "assistant", "tool"]  # 'developer' rendered as 'system'
    assert job.prompt.messages[1] == {"role": "user", "content": "a\nb", "name": "u"}
    assert job.prompt.messages[2]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert job.prompt.messages[3]["tool_call_id"] == "c1"


def test_completion_defaults_and_prompt_forms():
    job = completion_job(CompletionRequest.model_validate({"model": "m", "prompt": "hi"}), "r", "l")
    assert job.sampling.max_tokens == 16 and job.sampling.temperature == 1.0 and not job.sampling.logprobs
    assert job.prompt == TextPrompt(text="hi")
    assert completion_job(CompletionRequest(model="m", prompt=[1, 2]), "r", "l").prompt == TextPrompt(token_ids=[1, 2])
    assert completion_job(CompletionRequest(model="m", prompt=[[3]]), "r", "l").prompt == TextPrompt(token_ids=[3])
    for fields, param in [({"prompt": ["a", "b"]}, "prompt"), ({"echo": True}, "echo"), ({"best_of": 3}, "best_of")]:
        with pytest.raises(InvalidRequestError) as refused:
            completion_job(CompletionRequest.model_validate({"model": "m", "prompt": "x", **fields}), "r", "l")
        assert refused.value.param == param


@pytest.mark.parametrize(
    "error, status, type_, code, retry_after",
    [
        (ContextLengthExceededError("long", param="messages"), 400, "invalid_request_error", "context_length_exceeded", None),
        (InvalidRequestError("bad", param="top_p"), 400, "invalid_request_error", None, None),
        (ModelNotFoundError("who", param="model"), 404, "invalid_request_error", "model_not_found", None),
        (ModelExistsError("dup"), 409, "invalid_request_error", "model_already_loaded", None),
        (QueueFullError("full"), 429, "rate_limit_error", "queue_full", "1"),
        (QueueTimeoutError("slow"), 503, "server_error", "queue_timeout", "1"),
        (ModelLoadingError("wait", retry_after_s=7), 503, "server_error", "model_loading", "7"),
        (ModelLoadError("broken"), 503, "server_error", "model_load_failed", None),
        (EngineDeadError("dead"), 503, "server_error", "engine_dead", None),
        (OrchardError("odd"), 500, "server_error", "internal_error", None),
    ],
)
def test_error_mapping(error, status, type_, code, retry_after):
    wire = wire_error(error)
    assert wire.status == status
    assert wire.body == {"error": {"message": error.message, "type": type_, "param": error.param, "code": code}}
    assert wire.headers.get("Retry-After") == retry_after


def test_unexpected_errors_hide_their_details():
    wire = wire_error(KeyError("secret internals"))
    assert wire.status == 500 and "secret" not in wire.body["error"]["message"]


def _logprob(token: str, logprob: float) -> TokenLogprobInfo:
    return TokenLogprobInfo(token, list(token.encode()), logprob, [TopTokenLogprob(token, list(token.encode()), logprob)])


def test_chat_renderer_full_response_parses_as_openai():
    finish = Finish(FinishReason.STOP, Usage(5, 2, cached_tokens=3))
    total = StreamChunk(text="Hi!", num_tokens=2, logprobs=[_logprob("Hi", -0.1), _logprob("!", -0.2)], finish=finish)
    body = ChatRenderer(META).completion([total])
    parsed = ChatCompletion.model_validate(body)
    assert parsed.choices[0].message.content == "Hi!" and parsed.choices[0].finish_reason == "stop"
    assert parsed.usage.prompt_tokens_details.cached_tokens == 3 and parsed.usage.total_tokens == 7
    assert body["choices"][0]["logprobs"]["content"][1] == {
        "token": "!", "logprob": -0.2, "bytes": [33], "top_logprobs": [{"token": "!", "logprob": -0.2, "bytes": [33]}]
    }
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hi!", "refusal": None}


def test_chat_renderer_stream_sequence():
    renderer = ChatRenderer(META, include_usage=False)
    first = renderer.stream_payloads(StreamChunk(text="Hel", num_tokens=1))
    last = renderer.stream_payloads(StreamChunk(text="lo", num_tokens=1, finish=Finish(FinishReason.LENGTH, Usage(2, 2))))
    deltas = [p["choices"][0]["delta"] for p in first + last]
    assert deltas == [{"role": "assistant", "content": ""}, {"content": "Hel"}, {"content": "lo"}, {}]
    assert [p["choices"][0]["finish_reason"] for p in first + last] == [None, None, None, "length"]
    for payload in first + last:
        ChatCompletionChunk.model_validate(payload)
        assert "usage" not in payload


def test_completion_renderer_text_offsets_continue():
    renderer = CompletionRenderer(META)
    a = renderer.stream_payloads(StreamChunk(text="ab", num_tokens=2, logprobs=[_logprob("a", -1.0), _logprob("b", -1.0)]))
    b = renderer.stream_payloads(StreamChunk(text="cd", num_tokens=1, logprobs=[_logprob("cd", -1.0)]))
    assert a[0]["choices"][0]["logprobs"]["text_offset"] == [0, 1]
    assert b[0]["choices"][0]["logprobs"]["text_offset"] == [2]
    assert a[0]["choices"][0]["logprobs"]["top_logprobs"] == [{"a": -1.0}, {"b": -1.0}]


def test_an_error_after_the_headers_goes_into_the_stream():
    from deployments.ingress.generation import ChunkReader, _sse_body

    async def rest():
        yield StreamChunk(error=QueueTimeoutError("waited too long"))

    async def scenario():
        body = _sse_body(StreamChunk(text="a", num_tokens=1), ChunkReader(rest()), ChatRenderer(META))
        return [part async for part in body]

    parts = asyncio.run(scenario())
    assert parts[-1] == "data: [DONE]\n\n"
    assert json.loads(parts[-2].removeprefix("data: ")) == {"error": {
        "message": "waited too long", "type": "server_error", "param": None, "code": "queue_timeout"
    }}
    assert '"content":"a"' in parts[0]
