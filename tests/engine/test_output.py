"""Text output with SmolLM2's byte-level BPE tokenizer: stops, token ids, bias, penalties, logprobs."""

from __future__ import annotations

import math

import pytest

from engine import EngineConfig, EngineCore, Request, SamplingParams
from tests.engine.test_batching import assert_same_stream, run_alone
from tests.support.drive import Arrival, run_core

PROMPT_TEXT = "The quick brown fox jumps over the lazy dog. Once upon a time"


@pytest.fixture(scope="module")
def prompt(tiny_bpe_llama) -> list[int]:
    return tiny_bpe_llama.tokenizer.encode(PROMPT_TEXT)


@pytest.fixture(scope="module")
def reference(tiny_bpe_llama, prompt):
    """40 greedy tokens with no stop condition: the text every stop test cuts."""
    return run_alone(tiny_bpe_llama, "ref", prompt, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))


def test_streamed_text_equals_decoding_all_tokens(tiny_bpe_llama, reference):
    assert reference.text == tiny_bpe_llama.tokenizer.decode(reference.token_ids, skip_special_tokens=True)
    assert len(reference.text) > 40


def token_boundary_stop(tiny_bpe_llama, reference) -> tuple[str, int]:
    """A stop string that starts inside one token's text and ends inside a later one."""
    decode = lambda ids: tiny_bpe_llama.tokenizer.decode(ids, skip_special_tokens=True)
    ends = [len(decode(reference.token_ids[: i + 1])) for i in range(len(reference.token_ids))]
    for i in range(5, len(ends) - 2):
        start, stop_end = ends[i] - 1, ends[i + 1] + 1
        candidate = reference.text[start:stop_end]
        if ends[i + 1] > ends[i] and reference.text.find(candidate) == start and candidate.strip():
            return candidate, start
    pytest.fail("no usable token-spanning substring in the reference text")


def test_stop_string_split_across_tokens_ends_generation_and_is_not_emitted(tiny_bpe_llama, prompt, reference):
    stop, start = token_boundary_stop(tiny_bpe_llama, reference)
    sampling = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=(stop,))
    result = run_alone(tiny_bpe_llama, "s", prompt, sampling)
    assert result.text == reference.text[:start]
    assert result.finish.reason.value == "stop" and result.finish.stop_reason == stop
    assert stop not in result.text
    assert len(result.token_ids) < len(reference.token_ids)


def test_stop_token_id_ends_generation_without_its_text(tiny_bpe_llama, prompt, reference):
    stop_id = reference.token_ids[6]
    first = reference.token_ids.index(stop_id)
    sampling = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop_token_ids=(stop_id,), logprobs=True)
    result = run_alone(tiny_bpe_llama, "t", prompt, sampling)
    # One logprob per emitted token: the stop token is counted in usage but has no text and no logprob.
    assert len(result.logprobs) == first
    assert result.token_ids == reference.token_ids[: first + 1]
    assert result.text == tiny_bpe_llama.tokenizer.decode(reference.token_ids[:first], skip_special_tokens=True)
    assert result.finish.stop_reason == stop_id and result.finish.usage.completion_tokens == first + 1


def test_eos_stops_unless_ignored(tiny_bpe_llama, prompt):
    eos = next(iter(tiny_bpe_llama.eos_token_ids))
    forced = SamplingParams(max_tokens=10, temperature=0.0, logit_bias=((eos, 100.0),))
    result = run_alone(tiny_bpe_llama, "e", prompt, forced)
    assert result.token_ids == [eos] and result.text == "" and result.finish.reason.value == "stop"
    ignored = run_alone(tiny_bpe_llama, "e", prompt, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logit_bias=((eos, 100.0),)))
    assert ignored.token_ids == [eos] * 10 and ignored.finish.reason.value == "length"


def test_logit_bias_forces_and_bans_tokens(tiny_bpe_llama, prompt, reference):
    banned = reference.token_ids[0]
    result = run_alone(tiny_bpe_llama, "b", prompt, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logit_bias=((banned, -100.0),)))
    assert banned not in result.token_ids
    sampled = run_alone(tiny_bpe_llama, "b", prompt, SamplingParams(max_tokens=20, temperature=1.5, seed=1, ignore_eos=True, logit_bias=((banned, -100.0),)))
    assert banned not in sampled.token_ids


def test_penalties_change_output_and_batch_like_alone(tiny_llama):
    """On the 256-word model greedy decoding loops; penalties must break the loop, batched or not."""
    prompt = list(range(4, 19))
    plain = run_alone(tiny_llama, "p", prompt, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    penalised = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=True, repetition_penalty=1.5, frequency_penalty=1.0, presence_penalty=0.5)
    alone = run_alone(tiny_llama, "p", prompt, penalised)
    repeats = lambda ids: len(ids) - len(set(ids))
    assert repeats(alone.token_ids) < repeats(plain.token_ids)
    neighbours = [Request(f"n{i}", prompt[i:], SamplingParams(max_tokens=25, temperature=0.0, ignore_eos=True)) for i in range(3)]
    core = EngineCore(tiny_llama, EngineConfig())
    batched = run_core(core, [Arrival(0, Request("p", prompt, penalised))] + [Arrival(i, r) for i, r in enumerate(neighbours)])
    assert_same_stream(alone, batched["p"])


def test_top_logprobs_are_sorted_and_contain_the_greedy_choice(tiny_bpe_llama, prompt):
    core = EngineCore(tiny_bpe_llama, EngineConfig())
    core.add_request(Request("l", prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=5)))
    core.add_request(Request("m", prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=2)))
    entries = {"l": [], "m": []}
    while core.has_unfinished_requests():
        for output in core.step():
            entries[output.request_id] += output.delta.logprobs
    for rid, count in (("l", 5), ("m", 2)):
        assert len(entries[rid]) == 4
        for entry in entries[rid]:
            values = [t.logprob for t in entry.top_logprobs]
            assert len(values) == count and values == sorted(values, reverse=True)
            assert entry.top_logprobs[0].token_id == entry.token_id
            assert math.isclose(entry.top_logprobs[0].logprob, entry.logprob, abs_tol=1e-6)
            assert all(v <= 0 for v in values)


UNICODE_TEXT = "naïve café 東京 🍎🍏 def f(x):\n\treturn x ** 2  # ok\n¿Qué? <|im_end|> done"


@pytest.mark.parametrize("kind", ["byte_level", "window"])
def test_incremental_text_equals_full_decode_one_token_at_a_time(tiny_bpe_llama, kind):
    from engine.output.detokenizer import WindowSource, text_source_factory

    tokenizer = tiny_bpe_llama.tokenizer
    ids = tokenizer.encode(UNICODE_TEXT)
    source = text_source_factory(tokenizer)() if kind == "byte_level" else WindowSource(tokenizer)
    assert type(source).__name__ == ("ByteLevelSource" if kind == "byte_level" else "WindowSource")
    pieces = [source.add_token(t) for t in ids] + [source.finalize()]
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(pieces) == UNICODE_TEXT.replace("<|im_end|>", "")
    assert not any("\ufffd" in p for p in pieces)


def test_the_window_source_decodes_through_the_rust_backend_only_where_that_is_the_same_text(tiny_llama):
    from types import SimpleNamespace

    from engine.output.detokenizer import WindowSource, _decoder

    tokenizer = tiny_llama.tokenizer  # word-level (the benchmarks' kind): a window source
    assert tokenizer.clean_up_tokenization_spaces is False and _decoder(tokenizer) == tokenizer.backend_tokenizer.decode
    ids = tokenizer.encode("t5 t17 t200 t3 t42")
    source = WindowSource(tokenizer)
    streamed = "".join([source.add_token(t) for t in ids] + [source.finalize()])
    assert streamed == tokenizer.decode(ids, skip_special_tokens=True)
    # With the clean-up on, the tokenizer's own decode (which applies it) stays.
    cleaning = SimpleNamespace(backend_tokenizer=tokenizer.backend_tokenizer, clean_up_tokenization_spaces=True,
                               decode=tokenizer.decode)
    assert _decoder(cleaning) == tokenizer.decode
