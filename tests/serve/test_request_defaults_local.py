"""A chat request that names no max_tokens gets the model's default_max_tokens (issue 26: one such reply ran for
over 10 minutes on a CPU), cut to the room its prompt leaves; null restores "up to the context"."""

from __future__ import annotations

import asyncio

from deployments.config import ModelConfig
from tests.serve.local_stack import local_stack

CHAT = [{"role": "user", "content": "t1 t2"}]


def _ask(config: ModelConfig, messages: list[dict]) -> dict:
    async def scenario():
        async with local_stack([config]) as stack:
            body = {"model": config.id, "messages": messages, "temperature": 0, "ignore_eos": True}
            return (await stack.http.post("/v1/chat/completions", json=body)).json()

    return asyncio.run(scenario())


def test_an_omitted_max_tokens_is_the_models_default_cut_to_the_room_left(tiny_models):
    config = ModelConfig(model_id="m", model_path=str(tiny_models.alpha), context_length=64, default_max_tokens=7)
    short = _ask(config, CHAT)
    assert short["usage"]["completion_tokens"] == 7 and short["choices"][0]["finish_reason"] == "length"
    long_prompt = [{"role": "user", "content": " ".join(f"t{i}" for i in range(56))}]
    near_the_end = _ask(config, long_prompt)
    usage = near_the_end["usage"]
    assert 0 < usage["completion_tokens"] < 7 and usage["prompt_tokens"] + usage["completion_tokens"] == 64


def test_a_null_default_generates_up_to_the_context(tiny_models):
    config = ModelConfig(model_id="m", model_path=str(tiny_models.alpha), context_length=64, default_max_tokens=None)
    answer = _ask(config, CHAT)
    usage = answer["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 64
