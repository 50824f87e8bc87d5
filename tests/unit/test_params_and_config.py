"""Sampling parameter and prompt validation names the field; engine config accepts Bodega's names."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.request import Request
from engine.request_limits import RequestLimits
from engine.sampling.params import INT32_MAX, SamplingParams, make_logit_bias


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", 1.1),
        ("repetition_penalty", 0.0),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("max_tokens", 0),
        ("top_logprobs", 21),
        ("stop", ("",)),
        ("stop_token_ids", (1000,)),
        ("logit_bias", ((5000, 1.0),)),
        ("logit_bias", ((5, 101.0),)),
    ],
)
def test_invalid_values_are_refused_naming_the_field(field, value):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{field: value}).validate(vocab_size=1000)
    assert info.value.param == field
    assert field in info.value.message


def test_valid_values_pass():
    SamplingParams(
        max_tokens=5, temperature=0.0, top_p=0.5, top_k=-1, min_p=0.1, repetition_penalty=1.2,
        presence_penalty=-2.0, frequency_penalty=2.0, logit_bias=((3, -100.0),), seed=-7,
        stop=("x",), stop_token_ids=(999,), top_logprobs=20,
    ).validate(vocab_size=1000)


def test_logit_bias_keys_are_normalised_from_strings():
    assert make_logit_bias({"7": 1, 3: -2.5}) == ((3, -2.5), (7, 1.0))
    with pytest.raises(InvalidRequestError):
        make_logit_bias({"seven": 1})


def test_engine_limits_are_refused_naming_the_field():
    with pytest.raises(InvalidRequestError, match="max_decode_seqs"):
        EngineConfig(max_decode_seqs=0)
    assert EngineConfig(prefix_cache_bytes=0).prefix_cache_bytes == 0
    with pytest.raises(InvalidRequestError, match="byte budget"):
        EngineConfig(prefix_cache_bytes=10)


@pytest.mark.parametrize(
    "field, value, vocab_size",
    [
        ("top_k", 2**31, 1000),  # the sampler's int32 array cannot hold it (std::bad_cast killed the engine)
        ("top_k", 2**64, 1000),
        ("top_logprobs", 9, 8),  # more alternatives than the vocabulary has
        ("temperature", 1e39, 1000),  # beyond float32: infinity on the device
        ("temperature", 10**400, 1000),  # an int too large for a float
        ("repetition_penalty", 1e-40, 1000),  # rounds to 0 in float32: positive logits / 0
        ("repetition_penalty", 10**400, 1000),
        ("logit_bias", ((1.5, 1.0),), 1000),  # not a token id
        ("stop_token_ids", (2.5,), 1000),
    ],
)
def test_values_the_sampler_cannot_represent_are_refused_naming_the_field(field, value, vocab_size):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{field: value}).validate(vocab_size=vocab_size)
    assert info.value.param == field
    assert field in info.value.message


def test_representable_extremes_pass():
    """top_k above the vocabulary keeps every token; any int seed is reduced to 32 bits; float32's range is fine."""
    SamplingParams(
        top_k=INT32_MAX, seed=-(10**30), temperature=3e38, repetition_penalty=1e-37, top_p=1e-46, top_logprobs=8,
        logit_bias=((7, 100),), stop_token_ids=(0, 7),
    ).validate(vocab_size=8)
    SamplingParams(top_k=100_000).validate(vocab_size=256)


@pytest.mark.parametrize("token_id", [1.5, -1, 256, 2**31, 10**30])
def test_prompt_token_ids_outside_the_vocabulary_are_refused(token_id):
    limits = RequestLimits(vocab_size=256, context_length=64)
    with pytest.raises(InvalidRequestError) as info:
        limits.validate(Request("r", [1, token_id, 3], SamplingParams(max_tokens=4)))
    assert info.value.param == "prompt" and "0..255" in info.value.message


def test_every_typed_error_survives_pickling_with_its_fields():
    """Errors cross processes pickled (engine process, Ray, the stream channel): one that cannot be rebuilt from its
    message breaks the stream that carries it."""
    import inspect
    import pickle

    import engine.errors as errors

    classes = [c for _, c in inspect.getmembers(errors, inspect.isclass) if issubclass(c, errors.OrchardError)]
    assert len(classes) >= 10
    for cls in classes:
        error = cls("why")
        if hasattr(error, "retry_after_s"):
            error.retry_after_s = 7
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is cls and copy.message == "why" and copy.code == cls.code
        assert vars(copy) == vars(error)
