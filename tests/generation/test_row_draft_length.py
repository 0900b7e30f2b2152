"""The per-row draft-length policy of batched calls against fake cost / acceptance streams (no models, no timing)."""

import random

import pytest
import torch

from hf_budgetdraft.generation.draft_length import (
    FixedDraftLength,
    HeuristicDraftLength,
    RowDraftLength,
    SharedDraftLength,
)


def simulate(policy, acceptance: list[float], rounds: int, verify=(0.010, 0.001), draft=(0.001, 0.001)):
    """Feed `policy` rounds of a batch whose row b accepts each draft token with `acceptance[b]`; a round costs
    `verify[0] + verify[1]·Σγ` to verify and `draft[0] + draft[1]·G` to draft. Returns the `(rounds, B)` lengths."""
    rng = random.Random(0)
    rows = torch.arange(len(acceptance))
    chosen = []
    for _ in range(rounds):
        lengths = policy.next_lengths(rows, torch.full((len(rows),), 10_000))
        kept = []
        for gamma, rate in zip(lengths.tolist(), acceptance, strict=True):
            count = 0
            while count < gamma and rng.random() < rate:
                count += 1
            kept.append(count)
        longest = int(lengths.max())
        draft_seconds = draft[0] + draft[1] * longest if longest else 0.0
        policy.update(
            rows, lengths, torch.tensor(kept), draft_seconds, verify[0] + verify[1] * float(lengths.sum())
        )
        chosen.append(lengths.tolist())
    return torch.tensor(chosen)


def test_rows_that_accept_draft_long_and_rows_that_reject_take_ar_steps():
    # cheap drafts: the rows that accept finish far sooner for little cost, so they draft while the other steps
    chosen = simulate(
        RowDraftLength(maximum=8, rows=3),
        [0.95, 0.0, 0.9],
        rounds=120,
        verify=(0.010, 0.0002),
        draft=(0.0005, 0.0003),
    )
    late = chosen[40:]
    assert float((late[:, 0] >= 4).float().mean()) > 0.8 and float((late[:, 2] >= 3).float().mean()) > 0.8
    assert float((late[:, 1] == 0).float().mean()) > 0.9  # only probes draft for the row that never accepts
    assert bool(((late[:, 1] == 0) & (late[:, 0] > 0)).any())  # different lengths in one round


def test_no_row_drafts_when_drafting_cannot_pay():
    # every row rejects, drafts cheap: after its first rounds (the prior still hopes) only the scheduled probes
    # draft, and they get rarer
    cheap = {"verify": (0.010, 0.0002), "draft": (0.0005, 0.0003)}
    chosen = simulate(RowDraftLength(maximum=8, rows=4), [0.0] * 4, rounds=200, **cheap)
    assert chosen[0].tolist() == [4, 4, 4, 4]
    drafting_rounds = [i for i, row in enumerate(chosen.tolist()) if any(row) and i > 3]
    assert len(drafting_rounds) <= 6  # probes after 8, 16, 32, 64 AR rounds
    assert all(
        chosen[i].tolist() == [4, 4, 4, 4] for i in drafting_rounds
    )  # rows due together probe together
    gaps = [b - a for a, b in zip(drafting_rounds, drafting_rounds[1:], strict=False)]
    assert gaps == sorted(gaps) and gaps[-1] > 2 * gaps[0]  # the probes back off
    # the same rows, drafts dear: a probe could not pay even if the rows accepted at the prior, so none is drafted
    chosen = simulate(RowDraftLength(maximum=8, rows=4), [0.0] * 4, rounds=200)
    assert [i for i, row in enumerate(chosen.tolist()) if any(row)] == [0]
    # one token left: no probe either (the backoff doubles all the same)
    policy = RowDraftLength(maximum=8, rows=4)
    simulate(policy, [0.0] * 4, rounds=20, **cheap)
    policy.ar_streak[:] = 1_000
    assert policy.next_lengths(torch.arange(4), torch.full((4,), 1)).tolist() == [0, 0, 0, 0]
    policy.ar_streak[:] = 1_000
    assert policy.next_lengths(torch.arange(4), torch.full((4,), 500)).tolist() == [4, 4, 4, 4]
    # costly drafts: even a row that accepts everything stays at AR when a draft step costs more than it emits
    chosen = simulate(RowDraftLength(maximum=8, rows=2), [1.0, 1.0], rounds=60, draft=(0.05, 0.05))
    assert int((chosen[10:] > 0).sum()) <= 4


def test_a_batch_waits_for_its_slowest_row():
    # the batch ends when its last row does: drafting for one fast row among rows that cannot accept only pays when
    # it costs less than the row-steps it saves; here it does not, and the rows step together at AR
    mixed = simulate(
        RowDraftLength(maximum=8, rows=4),
        [0.9, 0.0, 0.0, 0.0],
        rounds=80,
        verify=(0.010, 0.0005),
        draft=(0.002, 0.0015),
    )
    assert int((mixed[20:] > 0).sum()) <= 8  # probes only
    # the same costs with every row accepting: every row drafts
    fitting = simulate(
        RowDraftLength(maximum=8, rows=4), [0.9] * 4, rounds=80, verify=(0.010, 0.0005), draft=(0.002, 0.0015)
    )
    assert float((fitting[20:] >= 3).float().mean()) > 0.8


def test_the_first_round_probes_and_the_second_measures_ar():
    policy = RowDraftLength(maximum=8, rows=2, probe_length=3)
    chosen = simulate(policy, [0.9, 0.9], rounds=3)
    assert chosen[0].tolist() == [3, 3]
    assert 0 in (chosen[1].tolist() + chosen[2].tolist()) or policy.ar_measured  # the AR step gets measured
    assert policy.ar_measured


def test_finished_rows_leave_the_policy_consistent():
    policy = RowDraftLength(maximum=4, rows=5)
    rows = torch.tensor([0, 2, 4])  # rows 1 and 3 finished
    lengths = policy.next_lengths(rows, torch.full((3,), 100))
    assert lengths.shape == (3,)
    policy.update(rows, lengths, torch.tensor([4, 0, 2]), 0.004, 0.02)
    assert policy.reached[1].sum() == 0 and policy.reached[2, 0] == 1 and policy.accepted[0].sum() == 4


def test_shared_lengths_are_the_plan_s_own():
    rows = torch.arange(3)
    shared = SharedDraftLength(FixedDraftLength(5))
    assert shared.next_lengths(rows, torch.ones(3)).tolist() == [5, 5, 5] and shared.name == "fixed"
    heuristic = SharedDraftLength(HeuristicDraftLength(length=4, maximum=8))
    heuristic.update(rows, torch.full((3,), 4), torch.tensor([4, 4, 4]), 0.0, 0.0)
    assert heuristic.next_lengths(rows, torch.ones(3)).tolist() == [
        6,
        6,
        6,
    ]  # +2 after a round every row kept


def test_bad_maximum_is_refused():
    with pytest.raises(ValueError, match="maximum must be >= 1"):
        RowDraftLength(maximum=0, rows=2)


@pytest.mark.parametrize("acceptance", [[0.0] * 4, [0.9, 0.0, 0.0, 0.0], [0.5, 0.6, 0.4, 0.7]])
def test_an_all_ar_plan_is_held_without_changing_a_decision(acceptance):
    # planning runs only when a round drafted, a row fell due or the hold ran out: the same lengths as planning
    # every round, for a fraction of the plans
    costs = {"verify": (0.010, 0.0005), "draft": (0.002, 0.0015)}
    held = RowDraftLength(maximum=8, rows=4)
    plans = []
    plan = held.plan
    held.plan = lambda *args: plans.append(1) or plan(*args)
    every_round = simulate(RowDraftLength(maximum=8, rows=4, replan_after=0), acceptance, rounds=200, **costs)
    assert torch.equal(simulate(held, acceptance, rounds=200, **costs), every_round)
    assert len(plans) < 200 // 4
