"""A draft length per row of a batched speculative round: rows whose drafts the target accepts may draft long while
rows whose drafts it rejects take a plain AR step in the same forward.

Row b drafting γ_b emits `e_b(γ_b) = 1 + Σ_{k<=γ_b} Π_{j<=k} a_bj` tokens in expectation, `a_bj` its acceptance at
draft position j (Leviathan et al., arXiv 2211.17192, §3.1, per row). A round costs, with G = max_b γ_b,

    c(γ) = c_ar + s·Σ_b γ_b + [G > 0]·(d_0 + G·d_step)

`c_ar` the batch's plain AR step, `s` one more verified token of one row (the target attends row by row, each row
for the queries it needs), `d_0 + G·d_step` the batch's draft (its first forward also feeds what each row's draft
cache has not seen); both lines are fitted to the call's own rounds. A call returns when its last row finishes, so
`RowDraftLength` picks the γ vector that minimises the expected time until every row has its remaining tokens —
rows leave as they finish, and the AR step splits into a per-round part and a per-row part — among all-AR and, for
each cap G, the vector with the most tokens per second of a round (each row's best γ_b <= G at that rate,
Dinkelbach's iteration). Drafting must be predicted to finish `switch_margin` sooner than all-AR.

Acceptance is learnt by drafting: the first round drafts `probe_length` tokens in every row, and a row left at
γ = 0 drafts `probe_length` once after 8, 16, ... 256 AR rounds, so a row whose text turns predictable is taken
back. Rows due together probe in one round (a drafting round costs every row: probing them apart costs one such round
per row). A short probe would teach too little: the gain of drafting comes from long accepted runs. A due probe is
skipped when drafting could not pay even if the rows accepted as well as the best row (few tokens left, or drafts
too dear beside this batch's AR step): in a static batch a row that does not fit is usually not the one the call
waits for. An all-AR plan holds for `replan_after` rounds unless a row falls due: what it rests on changes only
when a round drafts (acceptance) or slowly (the AR cost, the tokens left), and planning costs a batch's AR round
a few percent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .cost_fit import DecayedLinearFit
from .policy import DraftLength


@dataclass
class RowDraftLength:
    """Per-row adaptive draft length of a batched call (see the module docstring).

    Args:
        maximum (`int`): the longest draft of a row (the draft cache's rollback slack bounds it).
        rows (`int`): rows of the batch (indices the caller passes are original row indices, `< rows`).
        prior_acceptance (`float`): a priori acceptance of a draft token, before a row's first round.
        prior_weight (`float`): how many rounds the prior weighs.
        prior_draft_ratio (`float`): a priori cost of a draft step of the batch over its AR step.
        prior_verify_slope (`float`): a priori cost of one more verified token over a row's share of the AR step.
        decay (`float`): forgetting of old rounds.
        switch_margin (`float`): predicted gain drafting must show over all-AR.
        probe_length (`int`): what the first round and a probe draft.
        row_share (`float`): the part of the batch's AR step that scales with its rows (the rest — weights, launch
            and Python overhead — is paid per round whatever the rows); a prior, the rows rarely change enough to
            fit it.
        replan_after (`int`): rounds an all-AR plan is kept without planning again, unless a row falls due for a
            probe or a round drafts.
    """

    maximum: int
    rows: int
    prior_acceptance: float = 0.6
    prior_weight: float = 2.0
    prior_draft_ratio: float = 0.15
    prior_verify_slope: float = 0.15
    decay: float = 0.97
    switch_margin: float = 0.05
    probe_length: int = 4
    row_share: float = 0.6
    replan_after: int = 8
    name = "adaptive"

    def __post_init__(self):
        if self.maximum < 1:
            raise ValueError(f"maximum must be >= 1, got {self.maximum}")
        self.accepted = torch.zeros(
            self.rows, self.maximum, dtype=torch.float64
        )  # decayed counts per position
        self.reached = torch.zeros(self.rows, self.maximum, dtype=torch.float64)
        # verification seconds against Σγ (all-AR rounds anchor Σγ = 0, so a light ridge suffices), draft seconds
        # against G
        self.verify = DecayedLinearFit(self.decay, self.prior_verify_slope / self.rows, ridge=1.0)
        self.draft = DecayedLinearFit(self.decay, 0.2, ridge=1.0)  # a prior step: a fifth of the mean draft
        self.rounds = 0
        self.drafting_rounds_in_a_row = 0
        self.remeasure_after = 32
        self.ar_measured = False
        self.ar_streak = torch.zeros(self.rows, dtype=torch.long)  # AR rounds in a row, per row
        self.probe_after = torch.full((self.rows,), 8, dtype=torch.long)
        self.hold = 0  # all-AR rounds left before planning again

    # -- estimates -----------------------------------------------------------------------------------------------
    def acceptance(self, rows: torch.Tensor) -> torch.Tensor:
        """`(n, maximum)` posterior mean acceptance per draft position of the rows `rows`, each pooled towards the
        row's own overall acceptance (positions a row rarely reaches borrow its strength)."""
        accepted, reached, weight = self.accepted[rows], self.reached[rows], self.prior_weight
        pooled = (accepted.sum(-1, keepdim=True) + self.prior_acceptance * weight) / (
            reached.sum(-1, keepdim=True) + weight
        )
        return (accepted + pooled * weight) / (reached + weight)

    def expected_tokens(self, rows: torch.Tensor) -> torch.Tensor:
        """`(n, maximum + 1)`: expected tokens row b emits when it drafts γ = 0..maximum."""
        return _tokens_for(self.acceptance(rows))

    def costs(self, rows: int) -> tuple[float, float, float, float]:
        """`(c_ar, s, d_0, d_step)` in seconds for a batch of `rows` rows (relative units before any timing)."""
        if self.verify.count == 0:
            c_ar, slope = 1.0, self.prior_verify_slope / rows
        else:
            c_ar, slope = self.verify.coefficients()
        if self.draft.count == 0:
            return c_ar, slope, 0.0, self.prior_draft_ratio * c_ar
        return c_ar, slope, *self.draft.coefficients()

    def plan(self, rows: torch.Tensor, remaining: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(candidates (C, n), finish times (C,))` for the rows `rows`: all-AR, and for each cap G = 1..maximum the γ
        vector with the most expected tokens per second of a round (each row's best γ_b <= G at that rate,
        Dinkelbach's iteration), each with its `finish_time`."""
        tokens = self.expected_tokens(rows)  # (n, M + 1)
        n, top = len(rows), self.maximum
        c_ar, slope, draft_start, draft_step = self.costs(n)
        steps = torch.arange(top + 1, dtype=tokens.dtype)
        caps = torch.arange(1, top + 1)
        allowed = steps[None, :] <= caps[:, None]  # (G, M + 1)
        rate = torch.full((top,), n / c_ar, dtype=tokens.dtype)
        # Dinkelbach: maximise Σ e_b(γ_b) - rate · cost at each cap's current rate, then update the rate
        for _ in range(4):
            gain = tokens[None] - (rate * slope)[:, None, None] * steps  # (G, n, M + 1)
            gamma = gain.masked_fill(~allowed[:, None], -float("inf")).argmax(-1)  # (G, n)
            longest = gamma.max(-1).values.to(tokens.dtype)
            cost = c_ar + slope * gamma.sum(-1) + draft_start + draft_step * longest
            rate = tokens.gather(1, gamma.T).sum(0) / cost
        candidates = torch.cat([torch.zeros(1, n, dtype=torch.long), gamma])  # (G + 1, n)
        return candidates, self.finish_time(
            tokens, candidates, remaining, (c_ar, slope, draft_start, draft_step)
        )

    def finish_time(
        self, tokens: torch.Tensor, candidates: torch.Tensor, remaining: torch.Tensor, costs: tuple
    ) -> torch.Tensor:
        """`(C,)` expected seconds until every row has emitted its `remaining` `(n,)` tokens if row b drafts
        `candidates[c, b]` every round (`tokens` `(n, M + 1)`: `expected_tokens`; `costs`: `self.costs(n)`): a row
        leaves after `ceil(remaining_b / e_b(γ_b))` rounds, and a round costs the AR step's fixed part, each active
        row's part plus `s·γ_b`, and the draft of the longest active γ."""
        n = tokens.shape[0]
        c_ar, slope, draft_start, draft_step = costs
        emitted = tokens.T.gather(0, candidates)  # (C, n)
        rounds, order = (remaining.double()[None] / emitted).ceil().sort(-1)
        gamma = candidates.gather(1, order).double()
        per_row = self.row_share * c_ar / n + slope * gamma
        active_cost = per_row.flip(-1).cumsum(-1).flip(-1)  # rows order[i:] are active until rounds[i]
        longest = gamma.flip(-1).cummax(-1).values.flip(-1)
        draft = torch.where(longest > 0, draft_start + draft_step * longest, 0.0)
        spans = torch.diff(rounds, dim=-1, prepend=rounds.new_zeros(rounds.shape[0], 1))
        return (spans * ((1 - self.row_share) * c_ar + active_cost + draft)).sum(-1)

    # -- policy --------------------------------------------------------------------------------------------------
    def next_lengths(self, rows: torch.Tensor, remaining: torch.Tensor) -> torch.Tensor:
        """`(n,)` long: the draft length of each active row (`rows`: their original indices; `remaining`: the tokens
        each may still emit)."""
        rows, remaining = rows.cpu(), remaining.cpu().clamp(min=1)
        n = len(rows)
        probe = min(self.probe_length, self.maximum)
        if self.rounds == 0:
            return torch.full((n,), probe, dtype=torch.long)
        if self.rounds >= 2 and not self.ar_measured:
            return torch.zeros(n, dtype=torch.long)  # one all-AR round: what drafting is compared with
        if self.hold > 0 and not bool(self.falls_due(rows).any()):
            self.hold -= 1
            return torch.zeros(n, dtype=torch.long)  # nothing learnt since the last all-AR plan: keep it
        candidates, times = self.plan(rows, remaining)
        best = int(times.argmin())
        # all-AR unless drafting is predicted to finish sooner by more than the estimates' noise
        gamma = candidates[best] if times[best] < (1 - self.switch_margin) * times[0] else candidates[0]
        if bool(gamma.any()) and self.drafting_rounds_in_a_row >= self.remeasure_after:
            self.remeasure_after = min(2 * self.remeasure_after, 256)
            return torch.zeros(n, dtype=torch.long)  # re-measure the AR step
        # drafting pays for these rows: probe soon after their next fallback
        self.probe_after[rows[gamma > 0]] = 8
        due = (gamma == 0) & self.falls_due(rows)
        # rows that have not drafted for a while draft once, together (one drafting round), if it could pay
        if bool(due.any()):
            self.probe_after[rows[due]] = (self.probe_after[rows[due]] * 2).clamp(max=256)
            self.ar_streak[rows[due]] = 0
            if self.probe_could_pay(rows, remaining, gamma, due):
                gamma[due] = probe
        # hold an all-AR plan once the AR step it rests on is measured
        self.hold = self.replan_after if self.ar_measured and not bool(gamma.any()) else 0
        return gamma

    def falls_due(self, rows: torch.Tensor) -> torch.Tensor:
        """`(n,)` bool: the rows `rows` that have taken AR steps long enough to probe again."""
        return self.ar_streak[rows] >= self.probe_after[rows]

    def probe_could_pay(
        self, rows: torch.Tensor, remaining: torch.Tensor, gamma: torch.Tensor, due: torch.Tensor
    ) -> bool:
        """Whether drafting `probe_length` in the `due` `(n,)` rows would finish sooner than `gamma` `(n,)` if they
        accepted as well as the best active row (or the prior, if higher): a probe that could not pay even then
        (few tokens left, drafts too dear beside this batch's AR step) is skipped."""
        acceptance = self.acceptance(rows)  # (n, M)
        acceptance[due] = max(self.prior_acceptance, float(acceptance[:, 0].max()))
        tokens = _tokens_for(acceptance)
        probing = gamma.clone()
        probing[due] = min(self.probe_length, self.maximum)
        times = self.finish_time(tokens, torch.stack([gamma, probing]), remaining, self.costs(len(rows)))
        return bool(times[1] < times[0])

    def update(
        self,
        rows: torch.Tensor,
        drafted: torch.Tensor,
        accepted: torch.Tensor,
        draft_seconds: float,
        verify_seconds: float,
    ) -> None:
        """Record a round: row `rows[i]` drafted `drafted[i]` and kept `accepted[i]`; the round's two phase times."""
        rows, drafted, accepted = rows.cpu(), drafted.cpu(), accepted.cpu()
        self.rounds += 1
        drafting = drafted > 0
        any_drafted = bool(drafting.any())
        self.drafting_rounds_in_a_row = self.drafting_rounds_in_a_row + 1 if any_drafted else 0
        self.ar_streak[rows] = torch.where(drafting, 0, self.ar_streak[rows] + 1)
        if any_drafted:
            positions = torch.arange(self.maximum)[None]
            mine = rows[drafting]
            self.accepted[mine] *= self.decay
            self.reached[mine] *= self.decay
            kept, length = accepted[drafting][:, None], drafted[drafting][:, None]
            self.reached[mine] += ((positions <= kept) & (positions < length)).double()
            self.accepted[mine] += (positions < kept).double()
        if not (math.isfinite(verify_seconds) and verify_seconds > 0):
            return
        self.verify.add(float(drafted.sum()), verify_seconds)
        if any_drafted:
            self.draft.add(float(drafted.max()), draft_seconds)
        else:
            self.ar_measured = True


def _tokens_for(acceptance: torch.Tensor) -> torch.Tensor:
    """`(n, M + 1)` expected tokens a row emits drafting γ = 0..M, from its `(n, M)` acceptance per draft position."""
    survive = acceptance.cumprod(-1)
    return torch.cat([torch.ones(len(acceptance), 1, dtype=survive.dtype), 1 + survive.cumsum(-1)], -1)


class SharedDraftLength:
    """A batch-wide `DraftLength` (fixed, heuristic) behind the per-row interface: every row drafts its length."""

    def __init__(self, policy: DraftLength):
        self.policy = policy
        self.name = policy.name

    def next_lengths(self, rows: torch.Tensor, remaining: torch.Tensor) -> torch.Tensor:
        return torch.full((len(rows),), self.policy.next_length(), dtype=torch.long)

    def update(
        self,
        rows: torch.Tensor,
        drafted: torch.Tensor,
        accepted: torch.Tensor,
        draft_seconds: float,
        verify_seconds: float,
    ) -> None:
        gamma = int(drafted.max()) if len(drafted) else 0
        self.policy.update(
            gamma, accepted.tolist() if gamma else [0] * len(rows), draft_seconds, verify_seconds
        )
