"""The draft-length policies against fake cost / acceptance streams (no models, no timing)."""

import random

import pytest

from hf_budgetdraft.generation.draft_length import (
    AdaptiveDraftLength,
    FixedDraftLength,
    HeuristicDraftLength,
)


def draw_accepted(rng: random.Random, gamma: int, acceptance: float) -> int:
    """Draft tokens an i.i.d. drafter gets accepted in a round of `gamma`: each with `acceptance`, until one fails."""
    accepted = 0
    while accepted < gamma and rng.random() < acceptance:
        accepted += 1
    return accepted


def simulate(
    policy, acceptance: float, verify_base: float, verify_slope: float, draft_step: float, rounds: int
):
    """Feed `policy` rounds of an i.i.d. drafter (each draft token accepted with `acceptance`) whose phases cost
    exactly the given seconds; return the lengths it chose."""
    rng = random.Random(0)
    chosen = []
    for _ in range(rounds):
        gamma = policy.next_length()
        chosen.append(gamma)
        accepted = draw_accepted(rng, gamma, acceptance)
        policy.update(gamma, accepted, draft_step * gamma, verify_base + verify_slope * gamma)
    return chosen


def rate(gamma: int, acceptance: float, verify_base: float, verify_slope: float, draft_step: float) -> float:
    """Expected tokens per second of drafting `gamma` tokens a round."""
    tokens = sum(acceptance**k for k in range(gamma + 1))
    return tokens / (verify_base + verify_slope * gamma + draft_step * gamma)


def best_length(acceptance: float, verify_base: float, verify_slope: float, draft_step: float, maximum: int):
    return max(range(maximum + 1), key=lambda g: rate(g, acceptance, verify_base, verify_slope, draft_step))


@pytest.mark.parametrize(
    "acceptance,draft_step",
    [(0.9, 0.05), (0.7, 0.1), (0.5, 0.05), (0.8, 0.2)],
)
def test_adaptive_settles_on_the_optimum_when_drafting_pays(acceptance, draft_step):
    policy = AdaptiveDraftLength(maximum=16)
    chosen = simulate(policy, acceptance, 1.0, 0.05, draft_step, rounds=400)
    optimum = best_length(acceptance, 1.0, 0.05, draft_step, 16)
    assert optimum > 0
    best = rate(optimum, acceptance, 1.0, 0.05, draft_step)
    late = [rate(g, acceptance, 1.0, 0.05, draft_step) / best for g in chosen[-100:]]
    # the estimates are noisy and the curve is flat near its top: the choices reach >= 97% of the best rate
    assert sum(late) / len(late) >= 0.97, (optimum, chosen[-100:])
    assert rate(chosen[-1], acceptance, 1.0, 0.05, draft_step) > rate(0, acceptance, 1.0, 0.05, draft_step)


@pytest.mark.parametrize("acceptance,draft_step", [(0.0, 0.1), (0.2, 0.5), (0.5, 2.0)])
def test_adaptive_falls_back_to_plain_ar_when_drafting_cannot_pay(acceptance, draft_step):
    assert best_length(acceptance, 1.0, 0.05, draft_step, 16) == 0
    policy = AdaptiveDraftLength(maximum=16)
    chosen = simulate(policy, acceptance, 1.0, 0.05, draft_step, rounds=300)
    late = chosen[-200:]
    assert late.count(0) >= 180  # AR steps, with a few probing rounds in between
    assert any(g > 0 for g in late[1:])  # it keeps probing, so a drafter that improves is taken back


def test_adaptive_takes_the_drafter_back_when_it_improves():
    policy = AdaptiveDraftLength(maximum=16)
    simulate(policy, 0.0, 1.0, 0.05, 0.1, rounds=100)
    assert policy.next_length() == 0 or policy.ar_rounds_in_a_row == 0
    chosen = simulate(policy, 0.95, 1.0, 0.05, 0.1, rounds=300)
    assert chosen[-1] >= 8


def test_adaptive_never_drafts_beyond_its_maximum_and_ignores_the_prefill_round():
    policy = AdaptiveDraftLength(maximum=4)
    policy.update(4, 4, 100.0, 1000.0)  # round 1: both prefills, huge times; must not be fitted
    assert policy.verify.count == 0 and policy.draft.count == 0
    chosen = simulate(policy, 1.0, 1.0, 0.0, 0.01, rounds=50)
    assert max(chosen) == 4 and chosen[-1] == 4


def test_adaptive_corrects_an_inflated_first_ar_measurement():
    """The first AR step took 3x its cost (a noise spike): drafting looks better than it is. The periodic AR
    re-measurement corrects the estimate, and the policy ends up on plain AR, where it belongs."""
    acceptance, verify_base, verify_slope, draft_step, ar_step = 0.3, 1.3, 0.1, 0.15, 1.0
    # were an AR step as slow as the verify (1.3), drafting would pay...
    assert best_length(acceptance, verify_base, verify_slope, draft_step, 16) > 0
    rng, policy, chosen, first_ar = random.Random(1), AdaptiveDraftLength(maximum=16), [], True
    for _ in range(400):
        gamma = policy.next_length()
        chosen.append(gamma)
        if gamma == 0:  # ...but a plain AR step is cheaper than any drafting round here
            policy.update(0, 0, 0.0, 3 * ar_step if first_ar else ar_step)
            first_ar = False
            continue
        accepted = draw_accepted(rng, gamma, acceptance)
        policy.update(gamma, accepted, draft_step * gamma, verify_base + verify_slope * gamma)
    tokens_per_round = [sum(acceptance**k for k in range(g + 1)) for g in chosen[-200:]]
    costs = [ar_step if g == 0 else verify_base + (verify_slope + draft_step) * g for g in chosen[-200:]]
    assert sum(tokens_per_round) / sum(costs) >= 0.9 / ar_step  # within 10% of plain AR's rate
    assert chosen[-200:].count(0) >= 150


def test_expected_rates_match_the_closed_form():
    policy = AdaptiveDraftLength(maximum=3, prior_weight=1e-9)
    for _ in range(200):  # every position accepted half the time, exactly
        policy.update(3, 3, 0.3, 1.0)
        policy.update(3, 0, 0.3, 1.0)
        policy.update(3, 1, 0.3, 1.0)
    acceptance = policy.acceptance()
    assert acceptance[0] == pytest.approx(2 / 3, abs=0.02)  # 2 of 3 rounds accept position 1
    assert acceptance[1] == pytest.approx(1 / 2, abs=0.02)  # of the 2 that reach position 2, one accepts it


def test_fixed_and_heuristic_schedules():
    assert simulate(FixedDraftLength(5), 0.5, 1, 0, 0.1, 20) == [5] * 20
    heuristic = HeuristicDraftLength(length=4, maximum=8)
    heuristic.update(4, 4, 0.1, 1.0)
    assert heuristic.next_length() == 6
    heuristic.update(6, 2, 0.1, 1.0)
    assert heuristic.next_length() == 5
    for _ in range(10):
        heuristic.update(5, 5, 0.1, 1.0)
    assert heuristic.next_length() == 8
    with pytest.raises(ValueError, match="maximum"):
        AdaptiveDraftLength(maximum=0)


def test_the_first_drafting_round_is_not_fitted_and_an_ar_step_follows_it():
    policy = AdaptiveDraftLength(maximum=8)
    policy.update(2, 2, 5.0, 50.0)  # round 1: the prefills
    assert policy.next_length() > 0  # round 2 drafts on the priors...
    policy.update(5, 0, 10.0, 30.0)  # ...every path cold: slow, not fitted
    assert policy.verify.count == 0 and policy.draft.count == 0
    assert policy.next_length() == 0  # round 3 measures the AR step drafting competes with


def test_one_stall_does_not_keep_a_paying_drafter_off():
    """A drafting round that stalls (100x its draft time, 50x its verification) is one sample among many: the
    draft cost is a median and a verification counts for at most γ + 1 AR steps, so drafting resumes."""
    acceptance, draft_step = 0.8, 0.05
    rng, policy, chosen, stalled = random.Random(2), AdaptiveDraftLength(maximum=16), [], False
    for round_index in range(300):
        gamma = policy.next_length()
        chosen.append(gamma)
        accepted = draw_accepted(rng, gamma, acceptance)
        draft, verify = draft_step * gamma, (1.0 + 0.05 * gamma) if gamma else 1.0
        if gamma and round_index > 10 and not stalled:
            draft, verify, stalled = 100 * draft, 50 * verify, True
        policy.update(gamma, accepted, draft, verify)
    assert stalled and chosen[-100:].count(0) <= 5
    optimum = best_length(acceptance, 1.0, 0.05, draft_step, 16)
    late = [rate(g, acceptance, 1.0, 0.05, draft_step) for g in chosen[-100:]]
    assert sum(late) / len(late) >= 0.95 * rate(optimum, acceptance, 1.0, 0.05, draft_step)


def simulate_with_intercept(
    policy, acceptance: float, verify: tuple, draft: tuple, ar_step: float, rounds: int, seed: int = 5
):
    """Like `simulate`, with each phase `intercept + slope·γ` and γ = 0 costing `ar_step`; returns the lengths."""
    rng, chosen = random.Random(seed), []
    for _ in range(rounds):
        gamma = policy.next_length()
        chosen.append(gamma)
        accepted = draw_accepted(rng, gamma, acceptance)
        if gamma:
            policy.update(gamma, accepted, draft[0] + draft[1] * gamma, verify[0] + verify[1] * gamma)
        else:
            policy.update(0, 0, 0.0, ar_step)
    return chosen


def intercept_rate(gamma: int, acceptance: float, verify: tuple, draft: tuple, ar_step: float) -> float:
    if gamma == 0:
        return 1 / ar_step
    tokens = sum(acceptance**k for k in range(gamma + 1))
    return tokens / (verify[0] + draft[0] + (verify[1] + draft[1]) * gamma)


def test_a_draft_phase_with_an_intercept_is_fitted_as_one():
    """A round's first draft step is dear (caches left cold by the verification), the rest cheap: the policy fits
    `intercept + slope·γ` and finds the longer rounds that pay, where a per-token cost (the round's mean) would
    charge them the first step once per token and keep to γ = 1."""
    acceptance, verify, draft, ar_step = 0.7, (1.12, 0.1), (0.2, 0.15), 1.0
    optimum = max(range(17), key=lambda g: intercept_rate(g, acceptance, verify, draft, ar_step))
    assert optimum >= 2
    policy = AdaptiveDraftLength(maximum=16)
    chosen = simulate_with_intercept(policy, acceptance, verify, draft, ar_step, rounds=400)
    intercept, slope = policy.draft.coefficients()
    for gamma in set(chosen[-150:]) - {0}:  # the fit prices the rounds it drafts
        assert intercept + slope * gamma == pytest.approx(draft[0] + draft[1] * gamma, rel=0.1)
    late = [intercept_rate(g, acceptance, verify, draft, ar_step) for g in chosen[-150:]]
    best = intercept_rate(optimum, acceptance, verify, draft, ar_step)
    assert sum(late) / len(late) >= 0.93 * best
    assert sum(late) / len(late) > 1.08 / ar_step  # clearly faster than plain AR


def test_a_close_call_is_probed_often_and_a_clear_loss_rarely():
    """When drafting is predicted within `close_call` of AR, it probes every `close_probe_after` AR rounds; when it
    clearly loses, the probes back off (8, 16, 32, ... AR rounds)."""

    verify, draft = (1.2, 0.05), (0.1, 0.1)

    def probes(acceptance: float, seed: int) -> int:
        policy = AdaptiveDraftLength(maximum=8)
        chosen = simulate_with_intercept(policy, acceptance, verify, draft, 1.0, rounds=300, seed=seed)
        return sum(1 for g in chosen[-150:] if g > 0)

    best = max(intercept_rate(g, 0.42, verify, draft, 1.0) for g in range(1, 9))
    assert 0.95 < best < 1.0  # drafting loses, by less than the call's noise
    assert max(probes(0.0, seed) for seed in range(6)) <= 4
    # about one round in five on average; a run of bad luck can still leave one call on the doubling probes
    assert sum(probes(0.42, seed) for seed in range(6)) / 6 >= 15


def test_the_ar_cost_is_a_low_quartile_of_recent_measurements():
    policy = AdaptiveDraftLength(maximum=4)
    policy.update(2, 2, 5.0, 50.0)  # the prefills
    for seconds in (3.0, 1.0, 1.2, 1.1, 5.0, 1.3, 1.4, 1.5):
        policy.update(0, 0, 0.0, seconds)
    assert policy.ar_step == pytest.approx(1.2)  # sorted [1.0, 1.1, 1.2, ...][8 // 4]
    fresh = AdaptiveDraftLength(maximum=4)
    fresh.update(2, 2, 5.0, 50.0)
    for seconds in (3.0, 1.0):  # fewer than 4: the least
        fresh.update(0, 0, 0.0, seconds)
    assert fresh.ar_step == pytest.approx(1.0)
