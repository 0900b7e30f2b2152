"""The statistics the benchmark reports, as small pure functions (tested against hand-computed references).

- `wilson_interval` / `acceptance_intervals` (in `runs/intervals.py`, which a run's summary shows too): the
  acceptance rate and the conditional acceptance per draft position.
- `bootstrap_ci` / `paired_speedup`: percentile bootstrap (Efron & Tibshirani, 1993) over interleaved repeats. A
  repeat is one A B A B ... pass, so the baseline and the method of one repeat ran under the same machine load:
  they are resampled as pairs.
- `fit_line` / `fit_round_time`: ordinary least squares with standard errors, for Windowed-MTP's cost model
  (arXiv 2607.21535) `round_time = c + γ·t_draft_forward`, fitted on the per-round draft/verify times that
  `record_speculation` collects (γ = draft tokens proposed in the round).

Neither paper reports intervals (BudgetDraft: 10 samples per cell; Windowed-MTP: single runs per cell).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from ..runs.intervals import z_score

MAX_BOOTSTRAP_DRAWS = 1_000_000


def bootstrap_ci(
    data: Sequence[float] | Sequence[Sequence[float]] | np.ndarray,
    statistic: Callable[[np.ndarray], float],
    draws: int = 2000,
    confidence: float = 0.95,
    seed: int = 0,
    vectorized: bool = False,
) -> tuple[float, float]:
    """Percentile bootstrap interval of `statistic` over the rows of `data`.

    Rows are resampled with replacement (`draws` times, from a `numpy` generator seeded with `seed`, so the same
    inputs and seed always give the same interval); a 2-D `data` of shape `(n, k)` keeps each row's `k` values
    together (paired resampling).

    Args:
        data: `n` observations, `(n,)` or `(n, k)`.
        statistic (`Callable[[np.ndarray], float]`): maps a resample (same shape as `data`) to a number.
        draws (`int`): bootstrap resamples, in [1, 1e6].
        confidence (`float`): two-sided level.
        seed (`int`): the generator's seed.
        vectorized (`bool`): `statistic(resamples, axis=1)` computes all draws at once from the
            `(draws, n, ...)` array of resamples (e.g. `np.median`); same result, no Python loop.

    Returns:
        `(low, high)`; `(nan, nan)` for empty `data`.
    """
    z_score(confidence)
    if not 1 <= draws <= MAX_BOOTSTRAP_DRAWS:
        raise ValueError(f"draws must be in [1, {MAX_BOOTSTRAP_DRAWS}], got {draws}")
    array = np.asarray(data, dtype=float)
    n = array.shape[0] if array.ndim else 0
    if n == 0:
        return math.nan, math.nan
    rng = np.random.default_rng(seed)
    indices = rng.integers(0, n, size=(draws, n))  # (draws, n)
    if vectorized:
        values = np.asarray(statistic(array[indices], axis=1), dtype=float)  # (draws,)
    else:
        values = np.array([statistic(array[row]) for row in indices])
    alpha = 1 - confidence
    low, high = np.quantile(values, [alpha / 2, 1 - alpha / 2])
    return float(low), float(high)


def _median_of_ratios(pairs: np.ndarray, axis: int | None = None):
    """Median of `baseline / method` over the pairs (`pairs[..., 0] / pairs[..., 1]`)."""
    ratios = pairs[..., 0] / pairs[..., 1]
    return np.median(ratios, axis=-1 if axis is not None else None)


def paired_speedup(
    baseline_seconds: Sequence[float],
    method_seconds: Sequence[float],
    draws: int = 2000,
    confidence: float = 0.95,
    seed: int = 0,
) -> dict[str, float | int]:
    """Speed-up of a method over a baseline from interleaved repeats: the median of the per-repeat ratios
    `baseline_seconds[i] / method_seconds[i]` (same tokens generated, so = throughput ratio), with a paired
    bootstrap interval. The median keeps one repeat disturbed by another process from moving the estimate.

    Returns:
        `{"speedup", "low", "high", "n"}`.
    """
    if len(baseline_seconds) != len(method_seconds):
        raise ValueError(
            f"paired repeats: got {len(baseline_seconds)} baseline and {len(method_seconds)} method timings"
        )
    pairs = np.column_stack([np.asarray(baseline_seconds, float), np.asarray(method_seconds, float)])
    if pairs.size and (pairs <= 0).any():
        raise ValueError("timings must be > 0 seconds")
    if not len(pairs):
        return {"speedup": math.nan, "low": math.nan, "high": math.nan, "n": 0}
    low, high = bootstrap_ci(
        pairs, _median_of_ratios, draws=draws, confidence=confidence, seed=seed, vectorized=True
    )
    return {"speedup": float(_median_of_ratios(pairs)), "low": low, "high": high, "n": len(pairs)}


@dataclass
class LineFit:
    """`y = intercept + slope·x` by least squares; standard errors from the residual variance (n − 2 dof)."""

    intercept: float
    slope: float
    intercept_se: float
    slope_se: float
    r_squared: float
    n: int

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def fit_line(x: Sequence[float], y: Sequence[float]) -> LineFit:
    """Ordinary least squares `y = c + s·x` with standard errors.

    `s = Sxy / Sxx`, `c = ȳ − s·x̄`, `σ² = SSR / (n − 2)`, `se(s) = sqrt(σ² / Sxx)`,
    `se(c) = sqrt(σ² (1/n + x̄² / Sxx))`. With `n == 2` the line is exact and the errors are `nan`.

    Raises:
        `ValueError` with fewer than 2 points or when all `x` are equal (the slope is not identified: sweep γ).
    """
    xs, ys = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if xs.shape != ys.shape or xs.ndim != 1:
        raise ValueError(f"x and y must be 1-D of equal length, got shapes {xs.shape} and {ys.shape}")
    n = len(xs)
    if n < 2:
        raise ValueError(f"a line fit needs >= 2 points, got {n}")
    mx, my = xs.mean(), ys.mean()
    sxx = float(((xs - mx) ** 2).sum())
    if sxx == 0.0:
        raise ValueError(
            f"every x equals {mx:g}: the slope is not identified; measure several draft lengths (e.g. --gammas 2 4)"
        )
    slope = float(((xs - mx) * (ys - my)).sum()) / sxx
    intercept = float(my - slope * mx)
    residual = float(((ys - intercept - slope * xs) ** 2).sum())
    total = float(((ys - my) ** 2).sum())
    if n > 2:
        sigma2 = residual / (n - 2)
        slope_se = math.sqrt(sigma2 / sxx)
        intercept_se = math.sqrt(sigma2 * (1 / n + mx * mx / sxx))
    else:
        slope_se = intercept_se = math.nan
    r_squared = 1 - residual / total if total > 0 else 1.0
    return LineFit(intercept, slope, intercept_se, slope_se, r_squared, n)


def fit_round_time(
    proposed: Sequence[int], draft_seconds: Sequence[float], verify_seconds: Sequence[float]
) -> dict[str, LineFit]:
    """Windowed-MTP's cost model on measured rounds: `round = c + γ·t_draft_forward`, γ = tokens proposed.

    Also fits the draft and the verify phase alone against γ, so the attribution is visible: the draft slope is
    the cost of one draft forward, the verify slope the extra cost of verifying one more token (the "leak" of
    verification cost into the per-token term).

    Args:
        proposed (`Sequence[int]`): draft tokens proposed per round (exclude each call's first round: it holds
            the prefills).
        draft_seconds, verify_seconds (`Sequence[float]`): the phase times of the same rounds.

    Returns:
        `{"round": LineFit, "draft": LineFit, "verify": LineFit}` (slopes and intercepts in seconds).
    """
    if not len(proposed) == len(draft_seconds) == len(verify_seconds):
        raise ValueError(
            f"one value per round: got {len(proposed)} proposed, {len(draft_seconds)} draft and "
            f"{len(verify_seconds)} verify timings"
        )
    rounds = [d + v for d, v in zip(draft_seconds, verify_seconds, strict=True)]
    return {
        "round": fit_line(proposed, rounds),
        "draft": fit_line(proposed, draft_seconds),
        "verify": fit_line(proposed, verify_seconds),
    }
