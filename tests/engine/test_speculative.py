"""Speculative decoding never changes what the model says: with n-gram lookup or a draft model, alone or mixed
in a batch with rows that do not speculate, every row writes the tokens and logprobs of plain decoding."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import mlx.core as mx
import pytest

from engine import EngineConfig, EngineCore, Request, SamplingParams
from engine.models.loader import load_model
from engine.sampling.guided import GuidedDecoding
from engine.spec_decode.config import SpeculativeConfig
from tests.engine.test_batching import assert_same_stream
from tests.support.drive import Arrival, run_core
from tests.support.json_schemas import SCHEMAS, parse_and_validate, schema_text
from tests.support.tiny_models import LLAMA, write_model

# Not adaptive: every row drafts whenever it may, so the counts below do not depend on this machine's step times
# (the adaptive policy has its own tests, tests/unit/test_spec_decode.py).
NGRAM = SpeculativeConfig(method="ngram", num_draft_tokens=4, min_match=1, max_match=3, adaptive=False)


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory, wordlevel_tokenizer_dir):
    """A random model of the tiny llama's tokenizer, with other weights: its drafts are often rejected."""
    folder = write_model(tmp_path_factory.mktemp("draft"), dict(LLAMA, vocab_size=256), wordlevel_tokenizer_dir, seed=11, scale=3.0)
    return load_model(folder)


def draft_config(loaded, num_draft_tokens: int = 4, **extra) -> SpeculativeConfig:
    return SpeculativeConfig(
        method="draft", num_draft_tokens=num_draft_tokens, draft_model_path=str(loaded.path), adaptive=False, **extra
    )


def greedy(max_tokens: int = 24, **extra) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=True, **extra)


def seeded(seed: int, max_tokens: int = 24, **extra) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, temperature=0.9, top_p=0.9, seed=seed, ignore_eos=True, logprobs=True, top_logprobs=2,
        **extra,
    )


def repetitive(seed: int, length: int = 9, repeats: int = 3) -> list[int]:
    """A prompt that repeats itself: n-gram lookup finds matches in it."""
    base = [(seed * 37 + 11 * i) % 250 + 3 for i in range(length)]
    return base * repeats


def mixed_requests() -> list[Arrival]:
    """Greedy, seeded, penalised and non-speculating rows, arriving over a few steps (rows join mid-batch)."""
    requests = [
        Request("greedy", repetitive(1), greedy()),
        Request("seeded", repetitive(2), seeded(7)),
        Request("penalised", repetitive(3), greedy(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2)),
        Request("no-spec", repetitive(4), greedy(), speculative=False),
        Request("short", [9, 8, 7, 9, 8, 7], greedy(5)),
        Request("seeded-2", repetitive(5, length=5), seeded(99, max_tokens=30)),
    ]
    return [Arrival(i // 2, request) for i, request in enumerate(requests)]


def run(loaded, arrivals, speculative=None, draft=None, aborts=None, **config):
    config = {"max_decode_seqs": 8, **config}
    core = EngineCore(loaded, EngineConfig(speculative=speculative, **config), draft=draft)
    return run_core(core, arrivals, aborts), core


def fresh(arrivals: list[Arrival]) -> list[Arrival]:
    """The same arrivals as new Request objects (a Request is used by one core only)."""
    return [
        Arrival(a.step, Request(a.request.request_id, a.request.prompt_token_ids, a.request.sampling,
                                speculative=a.request.speculative))
        for a in arrivals
    ]


def assert_all_same(plain, speculated):
    assert set(plain) == set(speculated)
    for request_id in plain:
        assert_same_stream(plain[request_id], speculated[request_id])


def test_ngram_rows_write_what_plain_decoding_writes(tiny_llama):
    plain, _ = run(tiny_llama, mixed_requests())
    speculated, core = run(tiny_llama, mixed_requests(), NGRAM)
    assert_all_same(plain, speculated)
    stats = core.stats().speculation
    assert stats.verify_steps > 0 and stats.drafted_tokens > 0 and stats.accepted_tokens > 0
    # The row that asked not to speculate drafted nothing; usage reports the others' drafts.
    assert speculated["no-spec"].finish.usage.accepted_draft_tokens == 0
    assert speculated["no-spec"].finish.usage.rejected_draft_tokens == 0
    drafted = sum(u.accepted_draft_tokens + u.rejected_draft_tokens for u in (r.finish.usage for r in speculated.values()))
    assert drafted == stats.drafted_tokens
    assert sum(r.finish.usage.accepted_draft_tokens for r in speculated.values()) == stats.accepted_tokens


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_drafts_padded_to_the_widest_length_write_what_plain_decoding_writes(tiny_llama, other_draft, method):
    # Where attention builds a graph per shape (MLX CUDA, half precision), every verifying forward is as wide as
    # the longest draft allowed; the padded positions are computed and dropped with the rejected ones.
    config, draft = (NGRAM, None) if method == "ngram" else (draft_config(other_draft, num_draft_tokens=3), other_draft)
    config = dataclasses.replace(config, max_verify_tokens=64)  # a GPU's cap: the full length fits every batch here
    # A last request runs alone, long after the others: near its max_tokens its drafts are cut short, and padded.
    arrivals = lambda: mixed_requests() + [Arrival(100, Request("tail", repetitive(6), greedy(3)))]  # noqa: E731
    plain, _ = run(tiny_llama, arrivals())
    core = EngineCore(tiny_llama, EngineConfig(speculative=config, max_decode_seqs=8), draft=draft)
    core.runner.speculation.pad_widths = True
    if method == "ngram":  # drafts every step (prompt lookup finds none once a random model leaves the prompt's loop)
        core.runner.speculation.speculator.host_drafter = lambda request_id, known, length: known[-length:]
    steps = []  # every verifying forward
    dispatch = core.runner.speculation.dispatch
    core.runner.speculation.dispatch = lambda *args: steps.append(step := dispatch(*args)) or step
    speculated = run_core(core, arrivals(), None)
    assert_all_same(plain, speculated)
    max_verify = core.runner.speculation.speculator.max_verify_tokens  # rows x width, at most
    drafting = [s for s in steps if s.width > 1]  # width 1: no row found a draft after all
    assert drafting and all(s.width == 1 + min(config.num_draft_tokens, max_verify // len(s.rows) - 1) for s in drafting)
    assert any(max(row.num_drafts for row in s.rows) < s.width - 1 for s in drafting)  # some were padded


@pytest.mark.parametrize("which", ["itself", "other"])
def test_draft_model_rows_write_what_plain_decoding_writes(tiny_llama, other_draft, which):
    draft = load_model(tiny_llama.path) if which == "itself" else other_draft
    plain, _ = run(tiny_llama, mixed_requests())
    speculated, core = run(tiny_llama, mixed_requests(), draft_config(draft), draft)
    assert_all_same(plain, speculated)
    stats = core.stats().speculation
    assert stats.drafted_tokens > 0
    if which == "itself":  # greedy rows accept every draft of their own greedy self
        usage = speculated["greedy"].finish.usage
        assert usage.accepted_draft_tokens > 10 and usage.rejected_draft_tokens == 0


def test_a_lone_row_accepting_every_draft_writes_draft_plus_one_tokens_per_step(tiny_llama):
    # The lone row's cache is trimmed, not shifted; its own greedy self drafts exactly what it will say.
    config = draft_config(tiny_llama, num_draft_tokens=3)
    core = EngineCore(tiny_llama, EngineConfig(speculative=config), draft=load_model(tiny_llama.path))
    core.add_request(core.limits.validate(Request("r", [5, 6, 7, 8], greedy(9))))
    per_step = []
    while core.has_unfinished_requests():
        per_step.append(sum(len(o.new_token_ids) for o in core.step()))
    # Prefill's first token, then 3 drafts + the target's own token twice (the second capped by max_tokens);
    # the last step only frees the row's KV.
    assert per_step == [1, 4, 4, 0]
    plain, _ = run(tiny_llama, [Arrival(0, Request("r", [5, 6, 7, 8], greedy(9)))])
    assert core.stats().generation_tokens_total == len(plain["r"].token_ids) == 9


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 6])
def test_max_tokens_cuts_drafts_mid_step(tiny_llama, max_tokens):
    arrivals = [Arrival(0, Request("r", repetitive(6), greedy(max_tokens))), Arrival(0, Request("s", repetitive(7), seeded(3, max_tokens)))]
    plain, _ = run(tiny_llama, arrivals)
    speculated, _ = run(tiny_llama, fresh(arrivals), draft_config(tiny_llama, 4), load_model(tiny_llama.path))
    assert_all_same(plain, speculated)
    assert all(len(r.token_ids) == max_tokens and r.finish.reason.value == "length" for r in speculated.values())


def test_stop_tokens_and_strings_inside_accepted_drafts_end_the_row_there(tiny_llama):
    plain_tokens = run(tiny_llama, [Arrival(0, Request("r", repetitive(8), greedy(24)))])[0]["r"]
    stop_id, stop_text = plain_tokens.token_ids[9], tiny_llama.tokenizer.decode([plain_tokens.token_ids[14]])
    arrivals = [
        Arrival(0, Request("ids", repetitive(8), greedy(24, stop_token_ids=(stop_id,)))),
        Arrival(0, Request("text", repetitive(8), greedy(24, stop=(stop_text.strip(),)))),
    ]
    plain, _ = run(tiny_llama, arrivals)
    speculated, _ = run(tiny_llama, fresh(arrivals), draft_config(tiny_llama, 4), load_model(tiny_llama.path))
    assert_all_same(plain, speculated)
    assert speculated["ids"].finish.reason.value == "stop" and len(speculated["ids"].token_ids) <= 10
    assert speculated["text"].text == plain["text"].text and speculated["text"].finish.reason.value == "stop"


def test_an_abort_between_steps_leaves_the_other_rows_exact(tiny_llama):
    arrivals = mixed_requests()
    plain, _ = run(tiny_llama, arrivals, aborts={4: ["seeded"]})
    speculated, _ = run(tiny_llama, fresh(arrivals), NGRAM, aborts={4: ["seeded"]})
    assert speculated["seeded"].finish.reason.value == "abort"
    for request_id in plain:
        if request_id != "seeded":
            assert_same_stream(plain[request_id], speculated[request_id])


def test_guided_rows_decode_plainly_beside_speculating_rows(tiny_bpe_llama, prompt):
    guided = GuidedDecoding("json_schema", schema_text("flat_person"))
    arrivals = [
        Arrival(0, Request("json", prompt, SamplingParams(max_tokens=150, temperature=0.0, logprobs=True, guided=guided))),
        Arrival(0, Request("free", prompt * 3, greedy(30))),
    ]
    plain, _ = run(tiny_bpe_llama, arrivals)
    speculated, core = run(tiny_bpe_llama, fresh(arrivals), NGRAM)
    assert_all_same(plain, speculated)
    parse_and_validate(speculated["json"].text, SCHEMAS["flat_person"])
    assert speculated["json"].finish.usage.accepted_draft_tokens + speculated["json"].finish.usage.rejected_draft_tokens == 0


def test_rolled_back_rows_leave_the_prefix_cache_exact(tiny_llama):
    # Turn 1 speculates beside neighbours of other lengths (rows shifted on rollback), then leaves: the KV it
    # gives the prefix cache must serve turn 2 exactly as an uncached plain run.
    core = EngineCore(tiny_llama, EngineConfig(max_decode_seqs=8, prefix_block_size=8, speculative=NGRAM))
    turn1_prompt = repetitive(9, length=10)
    arrivals = [
        Arrival(0, Request("long", repetitive(10, length=20), greedy(30))),
        Arrival(1, Request("t1", turn1_prompt, greedy(17))),
        Arrival(2, Request("short", [4, 5, 4, 5], greedy(30))),
    ]
    turn1 = run_core(core, arrivals)["t1"]
    assert core.stats().speculation.accepted_tokens > 0
    turn2_prompt = turn1_prompt + turn1.token_ids + [11, 12, 13]
    turn2 = run_core(core, [Arrival(0, Request("t2", turn2_prompt, greedy()))])["t2"]
    assert turn2.finish.usage.cached_tokens >= len(turn1_prompt)
    plain, _ = run(tiny_llama, [Arrival(0, Request("t2", turn2_prompt, greedy()))], enable_prefix_cache=False)
    assert_same_stream(plain["t2"], turn2)
    core.runner.prefix_cache.check_integrity()


def test_models_whose_caches_cannot_be_trimmed_decode_plainly(wordlevel_tokenizer_dir, tmp_path):
    from tests.engine.test_architectures import GEMMA3_SLIDING

    sliding = load_model(write_model(tmp_path / "sliding", GEMMA3_SLIDING, wordlevel_tokenizer_dir, scale=3.0))
    speculated, core = run(sliding, mixed_requests(), NGRAM)
    assert core.runner.speculation is None and core.stats().speculation is None
    plain, _ = run(sliding, mixed_requests())
    assert_all_same(plain, speculated)


def test_a_draft_model_of_another_tokenizer_is_refused_at_load(tiny_llama, tiny_bpe_llama):
    from engine.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="tokenizer"):
        EngineCore(tiny_llama, EngineConfig(speculative=draft_config(tiny_bpe_llama)), draft=tiny_bpe_llama)


def test_sampled_rows_follow_the_targets_distribution(tiny_llama):
    # The third token of many seeded draws, among draws that began with the most common pair, against the
    # target's own probabilities there (temperature 1, top-k 6). It comes from a verifying position past an
    # accepted draft or from the position that rejected one, or from a later step: all must follow the target.
    prompt, draws = [17, 4, 17, 4, 17], 1200
    params = [SamplingParams(max_tokens=3, temperature=1.0, top_k=6, seed=s, ignore_eos=True) for s in range(draws)]
    arrivals = [Arrival(0, Request(f"d{s}", prompt, p)) for s, p in enumerate(params)]
    # Its own greedy self drafts: accepted as often as the target samples its top token, rejected otherwise.
    spec = draft_config(tiny_llama, 2, max_verify_tokens=4096)
    speculated, core = run(tiny_llama, arrivals, spec, load_model(tiny_llama.path), max_decode_seqs=128, max_num_seqs=draws)
    stats = core.stats().speculation
    assert stats.drafted_tokens > 500 and 0 < stats.accepted_tokens < stats.drafted_tokens
    pair = Counter(tuple(r.token_ids[:2]) for r in speculated.values()).most_common(1)[0][0]
    thirds = Counter(r.token_ids[2] for r in speculated.values() if tuple(r.token_ids[:2]) == pair)
    logits = tiny_llama.model(mx.array([prompt + list(pair)]))[0, -1].astype(mx.float32)
    top = mx.argsort(-logits)[:6].tolist()
    probs = mx.softmax(logits[mx.array(top)]).tolist()
    n = sum(thirds.values())
    assert n > 80 and set(thirds) <= set(top)
    chi_square = sum((thirds.get(t, 0) - n * p) ** 2 / (n * p) for t, p in zip(top, probs))
    assert chi_square < 20.5, (chi_square, thirds, probs)  # 5 degrees of freedom: p = 0.001


def test_seeded_speculation_is_reproducible_and_plain_identical(tiny_llama, other_draft):
    arrivals = [Arrival(0, Request(f"s{i}", repetitive(i), seeded(i))) for i in range(4)]
    first, _ = run(tiny_llama, arrivals, draft_config(other_draft, 3), other_draft)
    again, _ = run(tiny_llama, fresh(arrivals), draft_config(other_draft, 3), other_draft)
    plain, _ = run(tiny_llama, fresh(arrivals))
    assert_all_same(first, again)
    assert_all_same(plain, first)
    assert not math.isnan(sum(first["s0"].logprobs))


def test_draft_rows_that_sat_out_steps_catch_up_and_draft_right_again(tiny_llama):
    # The self-draft accepts every greedy draft. A verify budget of 6 positions fits one draft per row for 3
    # rows and none for 4: while a fourth request runs, the others decode plainly and their draft KV falls
    # behind (holding draft positions beyond what was verified); after it leaves they must catch up exactly.
    spec = draft_config(tiny_llama, 3, max_verify_tokens=6)
    arrivals = [Arrival(0, Request(f"g{i}", repetitive(20 + i), greedy(40))) for i in range(3)]
    arrivals.append(Arrival(6, Request("short", [3, 4, 5], greedy(8))))
    plain, _ = run(tiny_llama, arrivals)
    speculated, core = run(tiny_llama, fresh(arrivals), spec, load_model(tiny_llama.path))
    assert_all_same(plain, speculated)
    stats = core.stats().speculation
    assert stats.drafted_tokens > 20 and stats.accepted_tokens == stats.drafted_tokens
