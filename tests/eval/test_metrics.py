"""The bench's statistics against hand-computed references, and the greedy-diff helpers."""

import math

import numpy as np
import pytest
import torch

from hf_budgetdraft.eval.metrics import bootstrap_ci, fit_line, fit_round_time, paired_speedup
from hf_budgetdraft.runs.intervals import acceptance_intervals, wilson_interval
from hf_budgetdraft.runs.token_diff import TokenDiff, divergence_margin, noise_envelope, token_diff


def test_wilson_matches_published_values():
    # Newcombe (1998), Stat. Med. 17:857, table I: 8/10 -> 0.4902-0.9433, 0/10 -> 0-0.2775
    assert wilson_interval(8, 10) == pytest.approx((0.4902, 0.9433), abs=5e-5)
    assert wilson_interval(0, 10) == pytest.approx((0.0, 0.2775), abs=5e-5)
    assert wilson_interval(10, 10) == pytest.approx((0.7225, 1.0), abs=5e-5)
    # by hand: p = 1/3, z = 1.96: (p + z²/6 ± z·sqrt(p(1-p)/3 + z²/36)) / (1 + z²/3)
    z = 1.959963984540054
    center = (1 / 3 + z * z / 6) / (1 + z * z / 3)
    half = z * math.sqrt((1 / 3) * (2 / 3) / 3 + z * z / 36) / (1 + z * z / 3)
    assert wilson_interval(1, 3) == pytest.approx((center - half, center + half), abs=1e-12)
    # a wider level gives a wider interval
    low90, high90 = wilson_interval(8, 10, confidence=0.90)
    assert low90 > 0.4902 and high90 < 0.9433


def test_wilson_edge_cases_and_errors():
    low, high = wilson_interval(0, 0)
    assert math.isnan(low) and math.isnan(high)
    with pytest.raises(ValueError, match="0 <= successes <= trials"):
        wilson_interval(5, 3)
    with pytest.raises(ValueError, match="confidence must be in"):
        wilson_interval(1, 2, confidence=95)
    with pytest.raises(TypeError):
        wilson_interval(0.5, 2)


def test_acceptance_intervals_per_position():
    rows = acceptance_intervals([(8, 10), (0, 8), (0, 0)])
    assert [r["position"] for r in rows] == [1, 2, 3]
    assert rows[0]["rate"] == 0.8 and (rows[0]["low"], rows[0]["high"]) == pytest.approx(
        (0.4902, 0.9433), abs=5e-5
    )
    assert rows[1]["rate"] == 0.0 and rows[1]["low"] == 0.0
    assert math.isnan(rows[2]["rate"]) and rows[2]["reached"] == 0


def test_bootstrap_is_deterministic_given_a_seed():
    data = [1.0, 2.5, 0.7, 3.3, 2.2, 1.9, 0.4, 2.8]
    first = bootstrap_ci(data, np.median, draws=500, seed=3)
    assert bootstrap_ci(data, np.median, draws=500, seed=3) == first
    # another seed draws other resamples (the mean's percentiles move; the median's can tie on data points)
    assert bootstrap_ci(data, np.mean, draws=500, seed=4) != bootstrap_ci(data, np.mean, draws=500, seed=3)
    # the vectorized path draws the same resamples and gives the same interval
    assert bootstrap_ci(data, np.median, draws=500, seed=3, vectorized=True) == pytest.approx(first)
    low, high = first
    assert min(data) <= low <= np.median(data) <= high <= max(data)
    # no spread, no interval width
    assert bootstrap_ci([2.0] * 6, np.mean, draws=100) == (2.0, 2.0)
    assert all(math.isnan(v) for v in bootstrap_ci([], np.mean))
    with pytest.raises(ValueError, match="draws must be in"):
        bootstrap_ci(data, np.mean, draws=0)


def test_bootstrap_against_a_naive_loop():
    data = np.array([[3.0, 1.0], [4.0, 2.0], [6.0, 2.0], [5.0, 2.5]])  # paired rows
    rng = np.random.default_rng(11)
    indices = rng.integers(0, 4, size=(300, 4))
    naive = [np.median(data[row, 0] / data[row, 1]) for row in indices]
    expected = tuple(np.quantile(naive, [0.025, 0.975]))
    got = bootstrap_ci(data, lambda rows: np.median(rows[:, 0] / rows[:, 1]), draws=300, seed=11)
    assert got == pytest.approx(expected)


def test_paired_speedup():
    result = paired_speedup([2.0, 4.0, 6.0], [1.0, 2.0, 3.0], draws=200)
    assert result == {"speedup": 2.0, "low": 2.0, "high": 2.0, "n": 3}
    noisy = paired_speedup([2.0, 2.2, 1.8, 2.1], [1.0, 1.0, 1.2, 0.9], draws=400, seed=1)
    assert noisy["low"] <= noisy["speedup"] <= noisy["high"]
    assert noisy == paired_speedup([2.0, 2.2, 1.8, 2.1], [1.0, 1.0, 1.2, 0.9], draws=400, seed=1)
    with pytest.raises(ValueError, match="paired repeats"):
        paired_speedup([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="> 0 seconds"):
        paired_speedup([1.0], [0.0])


def test_line_fit_matches_hand_computation():
    # x̄ = 1.5, ȳ = 3.75, Sxx = 5, Sxy = 9.5 -> slope 1.9, intercept 0.9;
    # residuals 0.1, 0.2, -0.7, 0.4 -> SSR 0.70, σ² = 0.35; se(slope) = sqrt(0.35/5), se(c) = sqrt(0.35 (1/4 + 2.25/5))
    fit = fit_line([0, 1, 2, 3], [1, 3, 4, 7])
    assert fit.slope == pytest.approx(1.9)
    assert fit.intercept == pytest.approx(0.9)
    assert fit.slope_se == pytest.approx(math.sqrt(0.07))
    assert fit.intercept_se == pytest.approx(math.sqrt(0.245))
    assert fit.r_squared == pytest.approx(1 - 0.7 / 18.75)
    assert fit.n == 4
    exact = fit_line([1, 2], [3, 5])
    assert exact.slope == pytest.approx(2.0) and math.isnan(exact.slope_se)
    with pytest.raises(ValueError, match="slope is not identified"):
        fit_line([4, 4, 4], [1, 2, 3])
    with pytest.raises(ValueError, match=">= 2 points"):
        fit_line([1], [1])


def test_round_time_fit_recovers_the_cost_model():
    rng = np.random.default_rng(0)
    gammas = np.repeat([2, 4, 6, 8], 50)
    draft = 0.001 + 0.0005 * gammas + rng.normal(0, 1e-5, gammas.size)  # ctx-draft + γ·t_fwd
    verify = 0.004 + 0.0001 * gammas + rng.normal(0, 1e-5, gammas.size)
    fits = fit_round_time(gammas.tolist(), draft.tolist(), verify.tolist())
    assert fits["draft"].slope == pytest.approx(0.0005, abs=4 * fits["draft"].slope_se)
    assert fits["verify"].slope == pytest.approx(0.0001, abs=4 * fits["verify"].slope_se)
    assert fits["round"].slope == pytest.approx(fits["draft"].slope + fits["verify"].slope)
    assert fits["round"].intercept == pytest.approx(0.005, abs=4 * fits["round"].intercept_se)
    with pytest.raises(ValueError, match="one value per round"):
        fit_round_time([1, 2], [0.1], [0.1, 0.2])


def test_token_diff():
    a = torch.tensor([5, 6, 7, 8])
    assert token_diff(a, a.clone()) == TokenDiff(0, None, 4)
    changed = token_diff(torch.tensor([5, 6, 0, 8]), a)
    assert (changed.diff_tokens, changed.first_diff) == (1, 2)
    later = token_diff(torch.tensor([5, 1, 0, 0]), a)
    assert (later.diff_tokens, later.first_diff) == (3, 1)
    short = token_diff(torch.tensor([5, 6]), a)  # a run that stopped early differs at every missing position
    assert (short.diff_tokens, short.first_diff, short.compared) == (2, 2, 4)


def test_noise_envelope_rows():
    outputs = {
        "ar": [torch.tensor([1, 2, 3]), torch.tensor([1, 2, 3])],
        "native": [torch.tensor([1, 2, 3]), torch.tensor([1, 2, 4])],
        "sparse": [torch.tensor([1, 9, 3])],
    }
    rows = noise_envelope(
        outputs,
        [
            ("native_vs_ar", "native", "ar"),
            ("windowed_vs_native", "sparse", "native"),
            ("x", "missing", "ar"),
        ],
    )
    assert [(r["kind"], r["diff_tokens"], r["first_diff"], r["run_to_run"]) for r in rows] == [
        ("native_vs_ar", 0, None, 1),
        ("windowed_vs_native", 1, 1, 0),
    ]


def test_divergence_margin_is_the_targets_logit_gap():
    from hf_budgetdraft.demo.random_models import smoke_pair

    target, _ = smoke_pair(max_position_embeddings=128)
    prompt = torch.randint(0, 2048, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        greedy = target.generate(prompt, do_sample=False, max_new_tokens=4)[0, 20:]
        other = greedy.clone()
        other[2] = (greedy[2] + 1) % 2048
        logits = target(torch.cat([prompt[0], greedy[:2]])[None]).logits[0, -1]
    margin = divergence_margin(target, prompt, greedy, other, 2)
    assert margin == pytest.approx(float(logits[greedy[2]] - logits[other[2]]), rel=1e-5)
    assert margin > 0  # the greedy token is the target's argmax
    with pytest.raises(ValueError, match="index=9"):
        divergence_margin(target, prompt, greedy, other, 9)
