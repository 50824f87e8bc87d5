"""Speculative decoding's plain-Python parts: prompt lookup, draft lengths from acceptance, the verify budget."""

from __future__ import annotations

from engine.spec_decode.adaptive import DraftCosts, RowDraftPolicy, best_length, expected_tokens, fit_lengths
from engine.spec_decode.ngram import NgramIndex
from engine.spec_decode.speculator import Speculator
from engine.spec_decode.config import SpeculativeConfig


def index(tokens, min_match=2, max_match=4) -> NgramIndex:
    built = NgramIndex(min_match, max_match)
    built.extend(tokens)
    return built


def test_lookup_copies_what_followed_the_latest_longest_match():
    # "3 4" occurs twice before the end; the later one (followed by 9 8) wins; the 3-gram "2 3 4" wins over both.
    assert index([1, 3, 4, 7, 7, 3, 4, 9, 8, 5, 3, 4]).propose(2) == [9, 8]
    assert index([2, 3, 4, 6, 0, 3, 4, 9, 2, 3, 4]).propose(3) == [6, 0, 3]


def test_lookup_without_a_match_drafts_nothing_and_short_matches_are_ignored():
    assert index([1, 2, 3, 4, 5]).propose(4) == []
    assert index([1, 2, 9, 2], min_match=2).propose(4) == []  # only the 1-gram "2" recurs
    assert index([1, 2, 9, 2], min_match=1).propose(2) == [9, 2]


def test_a_match_near_the_end_repeats_its_continuation():
    # "7 8" at the end matched two tokens earlier: the text is periodic (7 8 7 8 ...).
    assert index([7, 8, 7, 8]).propose(5) == [7, 8, 7, 8, 7]


def test_the_index_grows_with_the_text():
    built = index([5, 6, 1])
    assert built.propose(3) == []
    built.extend([5, 6])
    assert built.propose(3) == [1, 5, 6]


def test_expected_tokens_and_the_best_length():
    assert expected_tokens(0.0, 4) == 1.0
    assert abs(expected_tokens(0.5, 2) - 1.75) < 1e-12
    assert expected_tokens(1.0, 3) == 4.0
    costs = DraftCosts(sync_cost=0.1, token_cost=0.03)
    assert best_length(0.0, 8, costs) == 0  # drafts that are never accepted cost the pipeline: decode plainly
    assert best_length(0.05, 8, costs) == 0
    assert 4 <= best_length(0.9, 8, costs) <= 8
    assert best_length(0.9, 2, costs) == 2  # capped by the allowance


def drafts_over(policy: RowDraftPolicy, steps: int, accepted_share: float, costs=DraftCosts(0.0, 0.03), rows=1) -> list[int]:
    """The row's draft length at each step, when it accepts that share of each step's drafts."""
    lengths = []
    for _ in range(steps):
        length = policy.length(4, costs, rows)
        if length:
            policy.record(length, int(length * accepted_share))
        lengths.append(length)
    return lengths


def test_a_row_that_stops_paying_backs_off_and_probes_again():
    policy = RowDraftPolicy(max_length=4)
    lengths = drafts_over(policy, 100, accepted_share=0.0)
    assert lengths[0] == 4  # the prior expects good acceptance
    probes = [i for i, n in enumerate(lengths) if n][-3:]
    assert all(lengths[i] == 1 for i in probes)  # once off, a row probes with one draft
    waits = [b - a - 1 for a, b in zip(probes, probes[1:])]
    assert waits == [16, 32]  # plain steps between probes, doubling while probes fail
    assert sum(lengths[probes[0] :]) == 3  # from the first probe on, all other steps are plain
    # The text turns repetitive: the next probe succeeds and the length grows back.
    assert max(drafts_over(policy, 80, accepted_share=1.0)[-5:]) == 4
    assert policy.length(0, DraftCosts()) == 0  # no allowance (max_tokens reached, or the request opted out)


def test_probes_wait_longer_in_bigger_batches_and_where_verifying_costs_more():
    # A probe makes the whole batch verify: 4 rows at a verify overhead of 1 plain step wait 4 x 2 times longer.
    policy = RowDraftPolicy(max_length=4)
    lengths = drafts_over(policy, 600, accepted_share=0.0, costs=DraftCosts(1.0, 0.03), rows=4)
    probes = [i for i, n in enumerate(lengths) if n]
    # The first wait follows the draft after which drafting stopped paying; then each failed probe doubles it:
    # 8, 16 and 32 steps, each times 4 x (1 + 1).
    assert [b - a - 1 for a, b in zip(probes, probes[1:])] == [8 * 8, 16 * 8, 32 * 8]


def test_a_drafting_row_whose_drafts_all_miss_once_does_not_back_off():
    # Drafts taken 70 % of the time miss whole about a third of the steps: the row keeps drafting after each such
    # miss (its acceptance estimate moves), without the probe back-off that would turn it off for long stretches.
    policy = RowDraftPolicy(max_length=4)
    costs = DraftCosts(0.1, 0.03)
    misses = 0
    for step in range(60):
        length = policy.length(4, costs)
        assert length > 0, f"step {step}: a row at ~70 % acceptance stopped drafting"
        accepted = 0 if step % 3 == 0 else min(length, 2)
        misses += accepted == 0
        policy.record(length, accepted)
    assert misses == 20 and policy.steps_to_probe == 0 and policy.probe_after == 8


def test_the_verify_budget_caps_every_rows_drafts():
    assert fit_lengths([4, 2, 0], num_rows=3, max_verify_tokens=64) == [4, 2, 0]
    assert fit_lengths([4, 4, 4, 4], num_rows=16, max_verify_tokens=64) == [3, 3, 3, 3]
    assert fit_lengths([4, 4], num_rows=64, max_verify_tokens=64) == [0, 0]  # compute-bound: no drafts


def test_the_speculator_plans_only_rows_with_a_match_and_an_allowance():
    speculator = Speculator(SpeculativeConfig(method="ngram", num_draft_tokens=3), max_verify_tokens=64)
    speculator.add("repeats", (1, 2, 3, 1, 2))
    speculator.add("fresh", (7, 8, 9))
    allowances = {"repeats": 3, "fresh": 3, "untracked": 3}
    # A batch size whose plain steps were never timed decodes plainly first (a verifying step's cost is relative).
    assert speculator.plan(allowances, batch_size=3) == {"repeats": 0, "fresh": 0, "untracked": 0}
    speculator.costs.observe_plain(3, 0.01)
    assert speculator.plan(allowances, batch_size=3) == {"repeats": 3, "fresh": 0, "untracked": 0}
    assert speculator.ngram_drafts({"repeats": 3}) == {"repeats": [3, 1, 2]}
    speculator.record_tokens("repeats", [3])
    assert speculator.ngram_drafts({"repeats": 2}) == {"repeats": [1, 2]}
    assert speculator.plan({"repeats": 0}, batch_size=1) == {"repeats": 0}
    speculator.record_verification("repeats", 3, 2)
    assert (speculator.stats.drafted_tokens, speculator.stats.accepted_tokens) == (3, 2)


def test_measured_step_costs_replace_the_prior():
    from engine.spec_decode.step_costs import StepCosts

    costs = StepCosts(DraftCosts(sync_cost=0.1, token_cost=0.03))
    assert costs.current() == DraftCosts(0.1, 0.03)  # nothing measured yet
    assert costs.current(8) == DraftCosts(0.1, 0.24)  # one more draft per row: 8 more positions
    costs.observe_verify(4, 5, 0.050)
    costs.observe_plain(4, 0.010)  # no plain step to compare that one with: still the prior
    assert costs.current().sync_cost == 0.1 and costs.sync_cost is None
    costs.observe_verify(4, 5, 0.050)  # 5x a plain step: 4 - 16 extra positions x 0.03 of fixed overhead
    assert costs.sync_cost is None  # fitted once the next step is timed
    costs.observe_plain(4, 0.010)
    assert abs(costs.current().sync_cost - (4 - 16 * 0.03)) < 1e-9
    assert best_length(0.7, 4, costs.current(4)) == 0  # drafts cannot pay that back
    for _ in range(60):  # the device warms up: verifying steps now cost 1.2 plain steps
        costs.observe_verify(4, 5, 0.012)
    assert costs.current().sync_cost < 0.1 and best_length(0.7, 4, costs.current(4)) > 0


def test_the_load_time_calibration_prices_the_pipeline_and_what_the_wider_forward_cost():
    from engine.spec_decode.step_costs import StepCosts

    def calibrated(one_s: float, many_s: float) -> tuple[float, float]:
        costs = StepCosts(DraftCosts(sync_cost=0.1, token_cost=0.03))
        costs.calibrate(one_s, many_s, width=3)
        return round(costs.current().sync_cost, 9), round(costs.current().token_cost, 9)

    # A 3-position forward 1.5x a single one: 0.5 plain steps built per shape, plus the pipeline given up.
    assert calibrated(0.010, 0.015) == (0.6, 0.03)
    # Faster than one position (timing noise on a tiny CPU model): the pipeline's price stands, no credit.
    assert calibrated(0.010, 0.008) == (0.1, 0.03)


def test_the_cost_per_extra_position_is_fitted_from_steps_of_several_widths():
    from engine.spec_decode.step_costs import StepCosts

    costs = StepCosts(DraftCosts(sync_cost=0.1, token_cost=0.03))
    costs.observe_plain(8, 0.010)
    for _ in range(10):  # 0.2 plain steps fixed, 0.05 per extra position: 8 rows x 1 draft, then 8 rows x 4
        costs.observe_verify(8, 2, 0.010 * (1 + 0.2 + 0.05 * 8))
        costs.observe_verify(8, 5, 0.010 * (1 + 0.2 + 0.05 * 32))
    costs.observe_plain(8, 0.010)
    fitted = costs.current(8)
    assert abs(fitted.sync_cost - 0.2) < 1e-9 and abs(fitted.token_cost - 0.4) < 1e-9
    # Half the drafts taken: eight rows' four drafts cost more than they return; a lone row's pay.
    assert best_length(0.5, 4, fitted) == 0
    assert best_length(0.5, 4, costs.current(1)) > 0


def test_the_pipeline_restart_after_a_verifying_step_counts_as_its_cost():
    from engine.spec_decode.step_costs import StepCosts

    costs = StepCosts(DraftCosts(sync_cost=0.1, token_cost=0.0))
    costs.observe_plain(1, 0.010)
    costs.observe_verify(1, 2, 0.012)
    # The next step overlapped nothing (3 ms of building its forward while the device idled): 0.2 + 0.3 overhead.
    costs.observe_plain(1, 0.003, pipelined=False)
    assert abs(costs.sync_cost - 0.5) < 1e-9
    assert costs.plain_s[1] == 0.010  # and it is no plain step's time
    costs.observe_plain(1, 0.002, pipelined=False)  # an unpipelined step with no verifying step before it: ignored
    assert abs(costs.sync_cost - 0.5) < 1e-9 and costs.plain_s[1] == 0.010


def test_a_batch_verifies_only_when_its_rows_expected_tokens_together_beat_the_cost():
    # Verifying makes every row of the batch wait and compute the longest draft: one predictable row among
    # seven unpredictable ones does not pay a verifying step that costs 1.5 plain steps; eight such rows do.
    speculator = Speculator(SpeculativeConfig(method="ngram", num_draft_tokens=4), max_verify_tokens=64)
    speculator.costs.observe_plain(8, 0.010)
    speculator.costs.observe_verify(8, 5, 0.010 * (1 + 0.5 + 32 * 0.03))  # fixed overhead 0.5 plain steps
    speculator.costs.observe_plain(8, 0.010)
    assert abs(speculator.costs.sync_cost - 0.5) < 1e-9
    for i in range(8):
        speculator.add(f"r{i}", (1, 2, 3, 1, 2))
        speculator.rows[f"r{i}"].policy.accepted, speculator.rows[f"r{i}"].policy.rejected = 9.0, 1.0  # alpha 0.9
    alone = speculator.plan({"r0": 4, **{f"r{i}": 0 for i in range(1, 8)}}, batch_size=8)
    assert set(alone.values()) == {0}
    together = speculator.plan({f"r{i}": 4 for i in range(8)}, batch_size=8)
    assert min(together.values()) >= 3


def test_rows_probe_together_and_never_where_no_draft_could_pay():
    speculator = Speculator(SpeculativeConfig(method="ngram", num_draft_tokens=4), max_verify_tokens=64)
    speculator.costs.observe_plain(3, 0.010)
    for name, wait in (("due", 0), ("later", 50), ("much-later", 200)):
        speculator.add(name, (1, 2, 3, 1, 2))
        policy = speculator.rows[name].policy
        policy.accepted, policy.rejected, policy.steps_to_probe = 0.0, 5.0, wait  # alpha 0: off
    # One row's probe is due: the others draft one token in the same verifying step.
    assert speculator.plan({"due": 4, "later": 4, "much-later": 4}, batch_size=3) == {"due": 1, "later": 1, "much-later": 1}
    # A device where a verifying step costs more than any draft could return: probes wait the longest back-off.
    policy = RowDraftPolicy(max_length=4, accepted=0.0, rejected=5.0)
    assert policy.length(4, DraftCosts(sync_cost=6.0, token_cost=0.03)) == 1  # the probe due now still runs
    policy.record(1, 0)
    assert policy.steps_to_probe >= 256


def test_a_new_row_starts_from_the_acceptance_the_models_recent_rows_met():
    speculator = Speculator(SpeculativeConfig(method="ngram", num_draft_tokens=4), max_verify_tokens=64)
    speculator.costs.observe_plain(1, 0.010)
    speculator.add("first", (1, 2, 3, 1, 2))
    assert speculator.plan({"first": 4}, batch_size=1) == {"first": 4}  # nothing measured yet: the fixed prior
    for _ in range(3):
        speculator.record_verification("first", 4, 0)
    speculator.add("second", (1, 2, 3, 1, 2))
    assert speculator.rows["second"].policy.acceptance == 2 / 3  # three verifications are not enough to go by
    speculator.record_verification("first", 4, 0)
    speculator.forget("first")
    # The model's drafts have all been rejected: a new request does not draft, and probes (one draft) only after
    # the back-off a failed probe would have started (8 steps x (1 + the prior's 0.1 sync cost)).
    speculator.add("third", (1, 2, 3, 1, 2))
    assert speculator.rows["third"].policy.acceptance == 0.0
    lengths = [speculator.plan({"third": 4}, batch_size=1)["third"] for _ in range(10)]
    assert lengths == [0] * 9 + [1]  # ceil(8 x 1.1) = 9
    # Drafts that are all taken again (a workload that turned repetitive) start the next requests at full length.
    for _ in range(200):
        speculator.record_verification("third", 4, 4)
    speculator.add("fourth", (1, 2, 3, 1, 2))
    assert speculator.rows["fourth"].policy.acceptance > 0.95
    assert speculator.plan({"fourth": 4}, batch_size=1)["fourth"] == 4
