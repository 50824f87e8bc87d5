"""Structured-output indexes build in child processes under a memory cap and a deadline (issue 48); the constraints
the issue reported are refused at submit, before any build, with the limit they passed."""

from __future__ import annotations

import asyncio
import json

import pytest

from engine import EngineConfig, EngineCore, Request, SamplingParams, ThreadEngineClient
from engine.errors import InvalidRequestError
from engine.models.loader import load_tokenizer_only
from engine.sampling.guide_builder import GuideBuilder
from engine.sampling.guided import GuidedDecoding
from engine.sampling.structured import build_vocabulary
from outlines_core import Index

# ~1 s and ~120 MB of index over SmolLM2's vocabulary on the 2-core test machine; a 1,000-character one ~4.5 s.
WIDE_STRING = '"[a-z ]{0,600}"'
SMALL = '"[a-z]{0,8}"'


@pytest.fixture(scope="module")
def vocabulary(smollm_tokenizer_dir):
    tokenizer = load_tokenizer_only(smollm_tokenizer_dir)
    return build_vocabulary(tokenizer, 49152, frozenset(tokenizer.eos_token_ids)).vocabulary


def same_index(built: Index, reference: Index) -> bool:
    start = reference.get_initial_state()
    return (built.get_initial_state() == start and built.get_final_states() == reference.get_final_states()
            and sorted(built.get_allowed_tokens(start)) == sorted(reference.get_allowed_tokens(start)))


def test_an_index_built_in_the_child_is_the_one_built_here(vocabulary) -> None:
    builder = GuideBuilder(vocabulary, workers=1)
    try:
        built = builder.build(SMALL, "guided_regex")
        assert same_index(built.index, Index(SMALL, vocabulary)) and built.size_bytes > 0
    finally:
        builder.close()


def test_a_build_over_its_memory_cap_is_refused_and_the_next_one_works(vocabulary) -> None:
    builder = GuideBuilder(vocabulary, workers=1, memory_bytes=150 << 20, seconds=120)
    try:
        with pytest.raises(InvalidRequestError, match="needed more memory than the limit of 150 MiB") as refused:
            builder.build(WIDE_STRING, "guided_regex")
        assert refused.value.param == "guided_regex"
        assert same_index(builder.build(SMALL, "guided_regex").index, Index(SMALL, vocabulary))
    finally:
        builder.close()


def test_a_build_over_its_deadline_is_refused_and_the_next_one_works(vocabulary) -> None:
    builder = GuideBuilder(vocabulary, workers=1, seconds=0.2)
    try:
        with pytest.raises(InvalidRequestError, match=r"took longer than the limit of 0.2 s"):
            builder.build(WIDE_STRING, "response_format")
        builder.seconds = 120
        assert same_index(builder.build(SMALL, "guided_regex").index, Index(SMALL, vocabulary))
    finally:
        builder.close()


REPORTED = [  # issue 48's reproductions: the first took the whole server down
    (GuidedDecoding("json_schema", json.dumps({"type": "string", "minLength": 10_000_000, "maxLength": 100_000_000})),
     "minLength 10,000,000 at # can never be met within max_tokens 4"),
    (GuidedDecoding("json_schema", json.dumps({"type": "array", "items": {"type": "string"}, "minItems": 1_000_000,
                                               "maxItems": 10_000_000})), "minItems 1,000,000 at #"),
    (GuidedDecoding("regex", "((a{100}){100}){100}", param="guided_regex"), "unroll to 1,000,000 positions"),
]


def test_the_reported_constraints_are_refused_at_submit_before_any_build(tiny_bpe_llama) -> None:
    async def scenario() -> None:
        engine = ThreadEngineClient(lambda: EngineCore(tiny_bpe_llama, EngineConfig()))
        await engine.start()
        try:
            for index, (guided, reason) in enumerate(REPORTED):
                request = Request(f"r{index}", [5, 6, 7], SamplingParams(max_tokens=4, guided=guided))
                with pytest.raises(InvalidRequestError, match=reason) as refused:
                    engine.submit(request)
                assert refused.value.param == guided.param
            assert engine.core.guides.stats().compiles == 0
            # A bound no output of max_tokens 4 can reach is dropped, and the request runs.
            reachable = GuidedDecoding("json_schema", json.dumps({"type": "string", "maxLength": 100_000_000}))
            stream = engine.submit(Request("ok", [5, 6, 7], SamplingParams(max_tokens=4, guided=reachable)))
            async for _ in stream:
                pass
            assert engine.core.guides.stats().compiles == 1
        finally:
            await engine.close()

    asyncio.run(scenario())
