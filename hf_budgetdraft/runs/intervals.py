"""Wilson score intervals of a binomial proportion (Wilson, JASA 1927): the acceptance rate and the conditional
acceptance per draft position a run reports, where counts are small and rates near 0 or 1 (the normal "Wald"
interval collapses there)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import numpy as np


def z_score(confidence: float) -> float:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), e.g. 0.95, got {confidence}")
    return statistics.NormalDist().inv_cdf(0.5 + confidence / 2)


def wilson_interval(successes: int, trials: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for `successes` out of `trials` Bernoulli trials.

    `(p + z²/2n ± z·sqrt(p(1-p)/n + z²/4n²)) / (1 + z²/n)` with `p = successes / trials`. Stays inside [0, 1] and
    is not degenerate at 0 or n successes. Returns `(nan, nan)` when `trials == 0` (no information).

    Args:
        successes (`int`): e.g. rounds that accepted draft position k.
        trials (`int`): e.g. rounds whose draft reached position k.
        confidence (`float`): two-sided level, 0.95 for a 95% interval.
    """
    if not (isinstance(successes, int | np.integer) and isinstance(trials, int | np.integer)):
        raise TypeError(f"successes and trials must be ints, got {successes!r} and {trials!r}")
    if not 0 <= successes <= trials:
        raise ValueError(f"need 0 <= successes <= trials, got successes={successes}, trials={trials}")
    z = z_score(confidence)
    if trials == 0:
        return math.nan, math.nan
    n, p = trials, successes / trials
    denominator = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    # exact bounds at the edges (avoid 1e-17 rounding outside [0, 1])
    low = 0.0 if successes == 0 else max(0.0, center - half)
    high = 1.0 if successes == trials else min(1.0, center + half)
    return low, high


def acceptance_intervals(
    counts: Sequence[tuple[int, int]], confidence: float = 0.95
) -> list[dict[str, float | int]]:
    """Conditional acceptance per draft position with Wilson intervals.

    Args:
        counts (`Sequence[tuple[int, int]]`): `(accepted, reached)` per position, as
            `SpeculationStats.acceptance_per_position()` returns (summed over calls if pooled).

    Returns:
        One dict per position `k` (1-based): `position, accepted, reached, rate, low, high` (`rate` is `nan` when
        no round reached position `k`).
    """
    rows = []
    for k, (accepted, reached) in enumerate(counts, start=1):
        low, high = wilson_interval(int(accepted), int(reached), confidence)
        rate = accepted / reached if reached else math.nan
        rows.append(
            {"position": k, "accepted": accepted, "reached": reached, "rate": rate, "low": low, "high": high}
        )
    return rows
