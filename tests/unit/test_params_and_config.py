"""Sampling parameter validation names the field; engine config accepts Bodega's names."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.sampling.params import SamplingParams, make_logit_bias


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
