"""One bad request never kills a model: per-request numbers the sampler cannot represent are refused at
validation, the ones it can run to a normal finish, and the engine serves the next request either way."""

from __future__ import annotations

import asyncio
import itertools
import math
from dataclasses import dataclass

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from engine import EngineConfig, EngineCore, Request, SamplingParams
from engine.client.thread_client import ThreadEngineClient
from engine.errors import InvalidRequestError
from engine.request import FinishReason
from engine.sampling.params import INT32_MAX
from engine.sampling.sampler import BatchSampler, RowSampling
from tests.engine.test_engine_clients import collect
from tests.support.drive import Arrival, Collected, run_core

VOCAB = 256  # the tiny_llama fixture's
PLAIN = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PLAIN_PROMPT = [11, 12, 13]


def sampled_tokens(loaded, top_k: int) -> list[int]:
    """A seeded, hot request's tokens, decoded beside a neighbour whose top_k makes the batch filter by top-k."""
    core = EngineCore(loaded, EngineConfig())
    tested = SamplingParams(max_tokens=16, temperature=3.0, top_k=top_k, seed=7, ignore_eos=True)
    neighbour = SamplingParams(max_tokens=16, temperature=3.0, top_k=5, seed=8, ignore_eos=True)
    results = run_core(core, [Arrival(0, Request("tested", [1, 2, 3], tested)), Arrival(0, Request("n", [4, 5], neighbour))])
    return results["tested"].token_ids


@pytest.mark.parametrize("top_k", [300, 100_000])
def test_top_k_at_or_above_the_vocabulary_keeps_every_token(tiny_llama, top_k):
    # Before: 300 read the neighbour's row past the end of its own (other tokens), 100,000 crashed natively.
    assert sampled_tokens(tiny_llama, top_k) == sampled_tokens(tiny_llama, 0)


def test_top_k_beyond_int32_is_refused_and_the_engine_keeps_serving(tiny_llama):
    async def scenario():
        client = ThreadEngineClient(lambda: EngineCore(tiny_llama, EngineConfig()))
        await client.start()
        try:
            with pytest.raises(InvalidRequestError) as info:
                client.submit(Request("huge", [1, 2, 3], SamplingParams(max_tokens=4, top_k=2**31)))
            assert info.value.param == "top_k"
            return await collect(client.submit(Request("plain", PLAIN_PROMPT, PLAIN))), client.health()
        finally:
            await client.close()

    (token_ids, _, finish), health = asyncio.run(asyncio.wait_for(scenario(), timeout=120))
    assert len(token_ids) == 6 and finish.reason == FinishReason.LENGTH and health.alive


def test_top_p_that_rounds_to_zero_in_float32_keeps_the_top_token():
    logits = mx.random.normal((2, VOCAB), key=mx.random.key(0))
    rows = [RowSampling(SamplingParams(top_p=1e-46), seed=3), RowSampling(SamplingParams(top_p=1e-46), seed=4)]
    sampled = BatchSampler(rows, VOCAB).sample(logits, [0, 0])
    assert sampled.token_ids.tolist() == mx.argmax(logits, axis=-1).tolist()


# ---- the property: random extreme parameters ------------------------------------------------------------
# Every field gets a value the engine must run (the edges of what it can represent); then at most one field
# gets any extreme value, so that both refusals and runs are common.
TOKEN_IDS = st.integers(0, VOCAB - 1)
RUNNABLE = {
    "max_tokens": st.one_of(st.none(), st.integers(1, 8)),
    "temperature": st.one_of(st.sampled_from([0.0, -0.0, 5e-324, 1e-40, 1e-6, 0.7, 2.0, 1e4, 3e38]),
                             st.floats(0.0, 3e38)),
    "top_p": st.one_of(st.sampled_from([5e-324, 1e-46, 1e-30, 0.1, 0.999, 1.0]), st.floats(0.0, 1.0, exclude_min=True)),
    "top_k": st.one_of(st.sampled_from([-1, 0, 1, 2, VOCAB - 1, VOCAB, VOCAB + 1, 100_000, INT32_MAX]),
                       st.integers(-1, INT32_MAX)),
    "min_p": st.one_of(st.sampled_from([0.0, 5e-324, 1e-46, 0.5, 1.0]), st.floats(0.0, 1.0)),
    "repetition_penalty": st.one_of(st.sampled_from([1e-37, 0.01, 1.0, 2.0, 1e30, 3e38]), st.floats(1e-37, 3e38)),
    "presence_penalty": st.floats(-2.0, 2.0),
    "frequency_penalty": st.floats(-2.0, 2.0),
    "logit_bias": st.lists(st.tuples(TOKEN_IDS, st.floats(-100.0, 100.0)), max_size=4).map(tuple),
    "seed": st.one_of(st.none(), st.integers(), st.sampled_from([-(10**40), 2**64, 10**30])),
    "stop_token_ids": st.lists(TOKEN_IDS, max_size=3).map(tuple),
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 20),
    "prompt": st.lists(TOKEN_IDS, min_size=1, max_size=6),
}
EXTREME_INTS = [-(2**63), -(2**31) - 1, -2, -1, 0, 1, VOCAB - 1, VOCAB, VOCAB + 1, 100_000,
                INT32_MAX, 2**31, 2**32, 2**63, 10**30]
EXTREME_FLOATS = [math.nan, math.inf, -math.inf, -0.0, 5e-324, 1e-46, 1e-40, 1e-37, 1e-6, 0.5, 0.999, 1.0, 2.0,
                  2.5, 100.0, 101.0, 1e4, 3e38, 3.5e38, 1e308, 10**400, -1.0, -2.0, -3.0]
INTS = st.one_of(st.integers(-2, VOCAB + 2), st.sampled_from(EXTREME_INTS))
NUMBERS = st.one_of(st.sampled_from(EXTREME_FLOATS), st.floats(), INTS)
ANY_VALUE = {
    **{name: NUMBERS for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                                  "frequency_penalty")},
    **{name: INTS for name in ("max_tokens", "top_k", "seed", "top_logprobs")},
    "logit_bias": st.lists(st.tuples(INTS, NUMBERS), min_size=1, max_size=4).map(tuple),
    "stop_token_ids": st.lists(INTS, min_size=1, max_size=3).map(tuple),
    "logprobs": st.booleans(),
    "prompt": st.lists(INTS, max_size=6),
}


@st.composite
def extreme_requests(draw) -> tuple[list[int], SamplingParams]:
    fields = {name: draw(strategy) for name, strategy in RUNNABLE.items()}
    broken = draw(st.one_of(st.none(), st.sampled_from(sorted(ANY_VALUE))))
    if broken is not None:
        fields[broken] = draw(ANY_VALUE[broken])
    prompt = fields.pop("prompt")
    return prompt, SamplingParams(ignore_eos=True, **fields)


_request_numbers = itertools.count()


def plain_tokens(core: EngineCore, beside: Request | None = None) -> tuple[list[int], dict[str, Collected]]:
    """A plain greedy request's tokens (and every result), run alone or beside another request."""
    plain = Request(f"plain-{next(_request_numbers)}", PLAIN_PROMPT, PLAIN)
    arrivals = [Arrival(0, plain)] + ([Arrival(0, beside)] if beside is not None else [])
    results = run_core(core, arrivals, max_steps=200)
    return results[plain.request_id].token_ids, results


@dataclass
class SharedEngine:
    core: EngineCore
    plain_tokens: list[int]  # what a plain request gets from the untouched engine


@pytest.fixture(scope="module")
def shared_engine(tiny_llama) -> SharedEngine:
    """One engine for every example: whatever a request did, the next one must still be served as before."""
    core = EngineCore(tiny_llama, EngineConfig(context_length=24))
    return SharedEngine(core, plain_tokens(core)[0])


@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(extreme_requests())
def test_random_extreme_parameters_are_refused_or_finish_and_the_engine_survives(shared_engine, prompt_and_params):
    core = shared_engine.core
    prompt, params = prompt_and_params
    request = Request(f"x-{next(_request_numbers)}", prompt, params)
    try:
        core.limits.validate(request)
    except InvalidRequestError as error:
        assert error.param in {*SamplingParams.__dataclass_fields__, "prompt"}, error.param
        event(f"refused: {error.param}")
    else:
        event("ran")
        plain, results = plain_tokens(core, beside=request)
        assert plain == shared_engine.plain_tokens  # its batch neighbour did not notice it
        outcome = results[request.request_id]
        assert outcome.finish.reason in (FinishReason.STOP, FinishReason.LENGTH)
        assert len(outcome.token_ids) <= request.sampling.max_tokens
        assert all(0 <= t < VOCAB for t in outcome.token_ids)
        assert all(math.isfinite(lp) and lp <= 1e-4 for lp in outcome.logprobs)
    assert plain_tokens(core)[0] == shared_engine.plain_tokens
    assert not core.has_unfinished_requests()


def test_huge_integer_temperature_and_penalty_are_numbers_the_sampler_takes(shared_engine):
    """Hypothesis found it: 10**20 is a valid repetition_penalty (and temperature) as a Python int, which MLX could not
    turn into a float32 array (std::bad_cast inside the step, then a corrupted engine)."""
    core = shared_engine.core
    params = SamplingParams(max_tokens=3, ignore_eos=True, temperature=10**20, repetition_penalty=10**20)
    request = Request(f"x-{next(_request_numbers)}", [1, 2, 3], params)
    core.limits.validate(request)
    plain, results = plain_tokens(core, beside=request)
    assert plain == shared_engine.plain_tokens
    assert results[request.request_id].finish.reason == FinishReason.LENGTH
