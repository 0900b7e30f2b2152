"""The expected decode speed-up of speculative rounds from measured costs and per-position acceptance.

A round that drafts γ tokens emits `1 + sum_{k<=γ} S_k` tokens in expectation (`S_k`: the chance that its first k
draft tokens are all accepted) and costs `c_verify(γ + 1) + c_draft(γ)`, against `c_verify(1)` for a plain AR step
(Leviathan et al., arXiv 2211.17192, §3.4, with a measured verification curve instead of a linear one). No
draft-length policy beats the best γ of this model on the same costs and acceptance.
"""

from __future__ import annotations

from collections.abc import Sequence


def survival(accepted: Sequence[int], gamma: int) -> list[float]:
    """`S_k`, k = 1 ... γ: the share of rounds whose first k draft tokens were all accepted."""
    if not accepted:
        raise ValueError("survival needs at least one round's accepted count, got none")
    return [sum(a >= k for a in accepted) / len(accepted) for k in range(1, gamma + 1)]


def constant_survival(alpha: float, gamma: int) -> list[float]:
    """`S_k = α^k`: every draft position accepted with the same chance α (a paper's reported acceptance rate)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be an acceptance rate in [0, 1], got {alpha}")
    return [alpha**k for k in range(1, gamma + 1)]


def expected_speedup(
    survive: Sequence[float],
    verify: Sequence[float],
    draft_a: float,
    draft_b: float,
    gamma: int,
    host: float = 0.0,
) -> float:
    """Decode speed of γ-token rounds over plain AR (γ = 0 is AR itself).

    Args:
        survive: `S_1 ... S_γmax`.
        verify: `c_verify(n)` seconds for n = 1 ... (index n - 1), at least γ + 1 of them.
        draft_a, draft_b: a round's draft seconds `a + b·γ`.
        gamma: draft tokens a round.
        host: seconds a speculative round spends beyond its forwards (an AR step's own overhead is in `verify[0]`
            where that was measured as a whole step).
    """
    if gamma == 0:
        return 1.0
    if gamma >= len(verify) or gamma > len(survive):
        raise ValueError(
            f"gamma={gamma} needs c_verify up to {gamma + 1} tokens and S_1..S_{gamma}; got {len(verify)} verify "
            f"costs and {len(survive)} survival values"
        )
    tokens = 1 + sum(survive[:gamma])
    return tokens * verify[0] / (verify[gamma] + draft_a + draft_b * gamma + host)


def best_draft_length(
    survive: Sequence[float], verify: Sequence[float], draft_a: float, draft_b: float, host: float = 0.0
) -> tuple[int, float]:
    """`(γ, speed-up)` of the best γ in 0 ... min(len(survive), len(verify) - 1)."""
    top = min(len(survive), len(verify) - 1)
    curve = [expected_speedup(survive, verify, draft_a, draft_b, g, host) for g in range(top + 1)]
    best = max(range(top + 1), key=curve.__getitem__)
    return best, curve[best]


def alpha_needed(goal: float, verify: Sequence[float], draft_a: float, draft_b: float) -> float | None:
    """The least acceptance α, equal at every position, for which the best γ reaches `goal` (None: no α <= 1)."""
    top = len(verify) - 1

    def best(alpha: float) -> float:
        return best_draft_length(constant_survival(alpha, top), verify, draft_a, draft_b)[1]

    if best(1.0) < goal:
        return None
    low, high = 0.0, 1.0
    for _ in range(30):
        middle = (low + high) / 2
        low, high = (middle, high) if best(middle) < goal else (low, middle)
    return high
