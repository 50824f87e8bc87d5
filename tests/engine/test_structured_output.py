"""Structured output through the engine, with SmolLM2's real byte-level BPE vocabulary.

Tiny random model: every schema of the suite yields valid JSON, alone, in one batch with
unconstrained rows (which stay exactly as they are alone) and streamed through the thread engine client.
The real SmolLM2 (slow): the same suite from chat prompts.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import pytest
from engine import EngineConfig, EngineCore, Request, SamplingParams, ThreadEngineClient
from engine.errors import InvalidRequestError
from engine.output.request_output import Finish, TextDelta
from engine.sampling.guided import GuidedDecoding
from engine.sampling.guided_regex import json_schema_regex
from engine.sampling.structured import GuideState
from tests.engine.test_batching import assert_same_stream, run_alone
from tests.support.drive import Arrival, run_core
from tests.support.json_schemas import SCHEMAS, parse_and_validate, schema_text

MAX_TOKENS = 150


def guided_params(index: int, guided: GuidedDecoding, max_tokens: int = MAX_TOKENS) -> SamplingParams:
    """Greedy and seeded random rows alternate, as in the batching tests."""
    if index % 2 == 0:
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=True, guided=guided)
    return SamplingParams(max_tokens=max_tokens, temperature=0.9, top_p=0.95, seed=100 + index, logprobs=True,
                          guided=guided)


def schema_requests(prompt: list[int]) -> list[Request]:
    return [
        Request(name, prompt + [i], guided_params(i, GuidedDecoding("json_schema", schema_text(name))))
        for i, name in enumerate(SCHEMAS)
    ]


def free_requests(prompt: list[int]) -> list[Request]:
    """Unconstrained rows to share the batch (ignore_eos: a fixed length, as in the batching tests)."""
    return [
        Request(f"free{i}", prompt + [7 * i], SamplingParams(max_tokens=24, temperature=0.0 if i % 2 else 0.8,
                                                             seed=i, ignore_eos=True, logprobs=True))
        for i in range(4)
    ]


def assert_valid(name: str, text: str, finish_reason: str) -> None:
    assert finish_reason == "stop", f"{name}: finished by {finish_reason} with {text!r}"
    parse_and_validate(text, SCHEMAS[name])


def test_suite_has_enough_schemas():
    assert len(SCHEMAS) >= 15


def test_every_schema_alone_and_batched_with_free_rows(tiny_bpe_llama, prompt):
    guided, free = schema_requests(prompt), free_requests(prompt)
    mixed = [r for pair in zip(guided, free + [None] * len(guided)) for r in pair if r is not None]
    core = EngineCore(tiny_bpe_llama, EngineConfig(max_decode_seqs=32, max_prefill_seqs=4, prefill_chunk_tokens=32))
    batched = run_core(core, [Arrival(i // 4, r) for i, r in enumerate(mixed)])
    for index, request in enumerate(guided):
        out = batched[request.request_id]
        assert_valid(request.request_id, out.text, out.finish.reason.value)
        if index % 3 == 0:  # a guided row's output does not depend on its neighbours (a sample, for time)
            alone = run_alone(tiny_bpe_llama, request.request_id, list(request.prompt_token_ids), request.sampling)
            assert_same_stream(alone, out)
    for request in free:
        alone = run_alone(tiny_bpe_llama, request.request_id, list(request.prompt_token_ids), request.sampling)
        assert_same_stream(alone, batched[request.request_id])  # exact logprobs: masks cost free rows nothing
    assert core.stats().num_steps < MAX_TOKENS  # the batch really was shared


async def collect(stream) -> tuple[list[str], Finish]:
    deltas, finish = [], None
    async for event in stream:
        if isinstance(event, TextDelta):
            deltas.append(event.text)
        elif isinstance(event, Finish):
            finish = event
    return deltas, finish


def test_suite_streamed_through_the_thread_client(tiny_bpe_llama, prompt):
    async def scenario():
        engine = ThreadEngineClient(lambda: EngineCore(tiny_bpe_llama, EngineConfig(max_decode_seqs=32)))
        await engine.start()
        try:
            requests = schema_requests(prompt) + free_requests(prompt)
            return await asyncio.gather(*(collect(engine.submit(r)) for r in requests))
        finally:
            await engine.close()

    results = asyncio.run(scenario())
    streamed_in_parts = 0
    for name, (deltas, finish) in zip(SCHEMAS, results):
        assert_valid(name, "".join(deltas), finish.reason.value)
        streamed_in_parts += len([d for d in deltas if d]) > 1
    assert streamed_in_parts > 0  # partial JSON reached the consumer before the end


def test_choice_and_tool_call_regex(tiny_bpe_llama, prompt):
    tool_schema = {"type": "object", "properties": {"name": {"const": "get_weather"}, "arguments": SCHEMAS["flat_person"]},
                   "required": ["name", "arguments"]}
    tool_regex = "<tool_call>\n" + json_schema_regex(tool_schema) + "\n</tool_call>"
    # (json_object is tested on the real model: a random one writes free-form strings without end.)
    kinds = {
        "choice": GuidedDecoding("choice", json.dumps(["yes", "no", "maybe (later)"])),
        "tool": GuidedDecoding("regex", tool_regex),
    }
    core = EngineCore(tiny_bpe_llama, EngineConfig())
    arrivals = [Arrival(0, Request(f"{name}{seed}", prompt + [seed], guided_params(seed, guided)))
                for name, guided in kinds.items() for seed in range(3)]
    results = run_core(core, arrivals)
    for request_id, out in results.items():
        assert out.finish.reason.value == "stop", (request_id, out.text)
        if request_id.startswith("choice"):
            assert out.text in ("yes", "no", "maybe (later)")
        else:
            body = re.fullmatch(r"<tool_call>\n(.*)\n</tool_call>", out.text, re.S)
            assert body is not None, out.text
            parse_and_validate(body.group(1), tool_schema)


def test_guided_request_ends_at_eos_even_with_ignore_eos(tiny_bpe_llama, prompt):
    guided = GuidedDecoding("choice", json.dumps(["done"]))
    core = EngineCore(tiny_bpe_llama, EngineConfig())
    request = Request("r", prompt, SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True, guided=guided))
    out = run_core(core, [Arrival(0, request)])["r"]
    assert (out.text, out.finish.reason.value) == ("done", "stop")
    assert out.token_ids[-1] in tiny_bpe_llama.eos_token_ids


def test_a_guide_rebuilt_from_output_tokens_matches_the_running_one(tiny_bpe_llama, prompt):
    """A preempted request rejoins with a fresh guide replayed over what it already wrote."""
    core = EngineCore(tiny_bpe_llama, EngineConfig())
    guided = GuidedDecoding("json_schema", schema_text("array_of_objects"))
    out = run_core(core, [Arrival(0, Request("r", prompt, guided_params(0, guided)))])["r"]
    compiled = core.guides.compile(guided)
    stepped = GuideState(compiled)
    for token_id in out.token_ids[:-1]:
        stepped.advance(token_id)
    replayed = GuideState(compiled, replay=out.token_ids[:-1])
    import numpy as np

    masks = [np.zeros(compiled.mask_words, np.int32) for _ in range(2)]
    stepped.write_mask(masks[0])
    replayed.write_mask(masks[1])
    assert (masks[0] == masks[1]).all() and not replayed.finished
    assert out.token_ids[-1] == compiled.eos_token_id


def test_logprobs_of_guided_rows_are_the_models_own(tiny_bpe_llama):
    """The mask decides the token, not the reported distribution (as for penalties and bias)."""
    import mlx.core as mx

    from engine.sampling.sampler import BatchSampler, RowSampling

    compiled = EngineCore(tiny_bpe_llama, EngineConfig()).guides.compile(GuidedDecoding("choice", '["yes"]'))
    params = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3, guided=GuidedDecoding("choice", '["yes"]'))
    free = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3)
    rows = [RowSampling(params, 0, guide=GuideState(compiled)), RowSampling(free, 0)]
    logits = mx.random.normal((2, tiny_bpe_llama.vocab_size), key=mx.random.key(0))
    sampled = BatchSampler(rows, tiny_bpe_llama.vocab_size).sample(logits, [0, 0])
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    token_ids = sampled.token_ids.tolist()
    assert tiny_bpe_llama.tokenizer.decode([token_ids[0]]) in ("y", "ye", "yes")  # the guide chose it
    assert token_ids[1] == int(mx.argmax(logits[1]))
    for row in range(2):
        assert abs(sampled.token_logprobs[row].item() - logprobs[row, token_ids[row]].item()) < 1e-6
        assert sampled.top_ids[row].tolist() == mx.argsort(-logprobs[row])[:3].tolist()


def test_invalid_specs_are_refused_before_queueing(tiny_bpe_llama, prompt):
    async def scenario():
        engine = ThreadEngineClient(lambda: EngineCore(tiny_bpe_llama, EngineConfig()))
        await engine.start()
        try:
            unsupported = json.dumps({"type": "array", "items": {"type": "integer"}, "uniqueItems": True})
            with pytest.raises(InvalidRequestError, match="uniqueItems") as refused:
                engine.submit(Request("a", prompt, SamplingParams(guided=GuidedDecoding("json_schema", unsupported))))
            assert refused.value.param == "response_format"
            with pytest.raises(InvalidRequestError, match="not valid JSON"):
                engine.submit(Request("b", prompt, SamplingParams(guided=GuidedDecoding("json_schema", "{oops"))))
            # A regex that only the index build can reject arrives as the stream's error.
            stream = engine.submit(Request("c", prompt, SamplingParams(guided=GuidedDecoding("regex", "(unclosed", param="guided_regex"))))
            with pytest.raises(InvalidRequestError, match="guided_regex") as failed:
                await collect(stream)
            assert failed.value.param == "guided_regex"
            assert engine.core.stats().num_steps == 0  # nothing was ever scheduled
        finally:
            await engine.close()

    asyncio.run(scenario())


def test_a_new_schema_compiles_without_stalling_other_streams(tiny_bpe_llama, prompt):
    # A free-form member makes the index take ~0.5 s to build; a fresh name defeats the cache.
    schema = {"type": "object", "properties": {f"meta{time.time_ns()}": {"type": "object"}}, "required": []}

    async def scenario():
        engine = ThreadEngineClient(lambda: EngineCore(tiny_bpe_llama, EngineConfig()))
        await engine.start()
        try:
            free = engine.submit(Request("free", prompt, SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)))
            arrivals: list[float] = []
            iterator = free.__aiter__()
            while len(arrivals) < 5:  # decoding is under way
                await anext(iterator)
                arrivals.append(time.monotonic())
            guided = GuidedDecoding("json_schema", json.dumps(schema))
            assert engine.core.guides.cached(guided) is None
            submitted = time.monotonic()
            stream = engine.submit(Request("new", prompt, SamplingParams(max_tokens=1, guided=guided)))
            first = asyncio.ensure_future(anext(stream.__aiter__()))
            while not first.done():
                await anext(iterator)
                arrivals.append(time.monotonic())
            await first
            return submitted, time.monotonic(), [t for t in arrivals if t > submitted]
        finally:
            await engine.close()

    submitted, answered, during = asyncio.run(scenario())
    # Counts, not gaps: the free stream kept decoding in both halves of the compile (a stall would leave one empty).
    middle = (submitted + answered) / 2
    assert len(during) >= 10
    assert any(t < middle for t in during) and any(t >= middle for t in during), (submitted, answered, during)


def test_a_request_aborted_while_its_schema_compiles_never_runs(tiny_bpe_llama, prompt):
    schema = {"type": "object", "properties": {f"gone{time.time_ns()}": {"type": "object"}}}

    async def scenario():
        engine = ThreadEngineClient(lambda: EngineCore(tiny_bpe_llama, EngineConfig()))
        await engine.start()
        try:
            guided = GuidedDecoding("json_schema", json.dumps(schema))
            stream = engine.submit(Request("gone", prompt, SamplingParams(max_tokens=5, guided=guided)))
            engine.abort("gone")
            deltas, finish = await collect(stream)
            while engine.core.guides.cached(guided) is None:  # the compile still finishes (and is cached)
                await asyncio.sleep(0.01)
            # A marker queued after the compile, through the same intake: had the aborted request been queued when
            # its compile ended, it would have run before or beside the marker, and counted in the engine's totals.
            marker = engine.submit(Request("marker", prompt, SamplingParams(max_tokens=3, guided=guided)))
            _, marker_finish = await collect(marker)
            return deltas, finish, marker_finish.usage, engine.core.stats()
        finally:
            await engine.close()

    deltas, finish, marker, stats = asyncio.run(scenario())
    assert deltas == [] and finish.reason.value == "abort" and finish.usage.completion_tokens == 0
    assert (stats.prompt_tokens_total, stats.generation_tokens_total) == (marker.prompt_tokens, marker.completion_tokens)
    assert stats.num_waiting == 0 and stats.num_running == 0


@pytest.fixture(scope="module")
def smollm2():
    from engine.models.default_model import default_model_path
    from engine.models.loader import load_model

    return load_model(default_model_path())


@pytest.mark.slow
def test_real_smollm2_suite_streamed_in_one_batch_with_a_free_request(smollm2):
    # A few raw tokens, no chat template (whose system prompt costs ~30 tokens a row): the guide, not
    # the prompt, decides the shape, and this CPU prefills SmolLM2 at only ~40 tokens/s.
    prompt = smollm2.tokenizer.encode("Example JSON:")
    requests = [Request(name, prompt, guided_params(i, GuidedDecoding("json_schema", schema_text(name)), max_tokens=90))
                for i, name in enumerate(SCHEMAS)]
    requests.append(Request("json_object", smollm2.tokenizer.encode("A cat as a JSON object:"),
                            SamplingParams(max_tokens=90, temperature=0.0, guided=GuidedDecoding("json_object"))))
    free = Request("free", smollm2.tokenizer.encode("A haiku about autumn:"),
                   SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=True))

    async def scenario():
        engine = ThreadEngineClient(lambda: EngineCore(smollm2, EngineConfig(max_decode_seqs=32)))
        await engine.start()
        try:
            return await asyncio.gather(*(collect(engine.submit(r)) for r in requests + [free]))
        finally:
            await engine.close()

    results = asyncio.run(scenario())
    for request, (deltas, finish) in zip(requests, results):
        text = "".join(deltas)
        if request.request_id == "json_object":
            assert finish.reason.value == "stop" and isinstance(json.loads(text), dict), text
        else:
            assert_valid(request.request_id, text, finish.reason.value)
    alone = run_alone(smollm2, "free", list(free.prompt_token_ids), free.sampling)
    assert "".join(results[-1][0]) == alone.text and len(alone.token_ids) == 16
