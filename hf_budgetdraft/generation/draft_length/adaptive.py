"""How many tokens a speculative round drafts: fixed, transformers' heuristic, or chosen online from cost and
acceptance.

A round that drafts γ tokens emits `1 + sum_{k<=γ} prod_{j<=k} a_j` tokens in expectation, `a_j` = the probability
that draft token j is accepted given that tokens 1..j-1 were (Leviathan et al., arXiv 2211.17192, §3.1, with
per-position rates), and costs `c_verify(γ) + c_draft(γ)` seconds, each linear in γ with an intercept (a round's
first draft step runs on caches the verification left cold). `AdaptiveDraftLength` keeps running estimates of all
of them from the call's own rounds and drafts the γ in [0, max] with the most expected tokens per second. γ = 0
is a plain autoregressive step (the target alone), so speculation that cannot pay — a poor drafter, long context
with low acceptance, sampling at a high temperature — falls back to AR instead of slowing the call down.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .cost_fit import DecayedLinearFit
from .policy import DraftLength

FIRST_PROBE_AFTER = 8  # AR rounds before a probing round drafts again (doubling while probes fail)
FIRST_REMEASURE_AFTER = 32  # drafting rounds before the AR step is measured again (doubling)
MOST_ROUNDS_BETWEEN_CHECKS = 256  # the most either interval grows to


@dataclass
class AdaptiveDraftLength(DraftLength):
    """Each round drafts `argmax_γ E[tokens | γ] / (c_verify(γ) + c_draft(γ))` over γ in [0, `maximum`].

    Acceptance per draft position: a Beta prior (mean `prior_acceptance`, weight `prior_weight` rounds) pooled
    towards the call's overall rate. Costs: prior ratios to the verification step until the call's own timings
    replace them, verification and drafting each fitted as `intercept + slope·γ` (decayed by `decay`; a round counts
    for at most γ AR steps of drafting and γ + 1 of verification). The first round (prefills) and the second (cold
    paths) are not fitted; the third is a plain AR step, re-measured after `FIRST_REMEASURE_AFTER`, ... drafting
    rounds in a row, its cost the lower quartile of the last `ar_samples`. After a run of γ = 0 it probes one
    drafting round after `FIRST_PROBE_AFTER`, doubling to `MOST_ROUNDS_BETWEEN_CHECKS` AR rounds — every
    `close_probe_after` in a close call (drafting within `close_call` of AR were its acceptance one posterior
    standard deviation higher). Why each rule, and what it was measured against: docs/fast_default.md, "The
    adaptive draft length".

    Args:
        maximum (`int`): the longest round (the draft cache's rollback slack bounds it).
        prior_acceptance (`float`): a priori acceptance of a draft token, before any round.
        prior_draft_ratio (`float`): a priori cost of one draft step over a one-token verification.
        prior_draft_slope (`float`): a priori share of a round's mean draft time that one more draft token adds.
        prior_verify_slope (`float`): a priori cost of one more verified token over a one-token verification.
        switch_margin (`float`): drafting must be predicted to beat the AR step by this fraction, so noise in the
            estimates does not buy rounds that lose.
        ar_samples (`int`): AR-step measurements the cost estimate keeps.
        close_call (`float`): drafting that would reach `1 - close_call` times AR's rate with its acceptance one
            posterior standard deviation higher is a close call.
        close_probe_after (`int`): AR rounds between probing rounds in a close call.
    """

    maximum: int
    prior_acceptance: float = 0.6
    prior_weight: float = 2.0
    prior_draft_ratio: float = 0.1
    prior_draft_slope: float = 0.5
    prior_verify_slope: float = 0.05
    decay: float = 0.97
    switch_margin: float = 0.05
    ar_samples: int = 8
    close_call: float = 0.05
    close_probe_after: int = 4
    name = "adaptive"

    def __post_init__(self):
        if self.maximum < 1:
            raise ValueError(f"maximum must be >= 1, got {self.maximum}")
        self.accepted = [0.0] * self.maximum  # decayed counts per draft position
        self.reached = [0.0] * self.maximum
        self.verify = DecayedLinearFit(self.decay, self.prior_verify_slope)  # rounds that drafted
        self.draft = DecayedLinearFit(self.decay, self.prior_draft_slope)  # their draft phases
        self.ar_times: list[float] = []  # rounds that did not: the target's plain one-token step
        self.rounds = 0
        self.ar_rounds_in_a_row = 0
        self.drafting_rounds_in_a_row = 0
        self.remeasure_after = FIRST_REMEASURE_AFTER
        self.probe_after = FIRST_PROBE_AFTER

    @property
    def ar_step(self) -> float | None:
        """The plain AR step's cost: the lower quartile of its recent measurements (`None` before the first)."""
        return sorted(self.ar_times)[len(self.ar_times) // 4] if self.ar_times else None

    # -- estimates -----------------------------------------------------------------------------------------------
    def acceptance(self, optimism: float = 0.0) -> list[float]:
        """Posterior mean acceptance per draft position, `(maximum,)`; `optimism` > 0 adds that many posterior
        standard deviations (capped at 1): what the acceptance may still be, given how little was seen."""
        pooled = (sum(self.accepted) + self.prior_acceptance * self.prior_weight) / (
            sum(self.reached) + self.prior_weight
        )
        estimates = []
        for accepted, reached in zip(self.accepted, self.reached, strict=True):
            seen = reached + self.prior_weight
            mean = (accepted + pooled * self.prior_weight) / seen
            estimates.append(min(1.0, mean + optimism * math.sqrt(mean * (1 - mean) / (seen + 1))))
        return estimates

    def costs(self) -> tuple[float, float, float, float, float]:
        """`(AR step, verify intercept, verify slope, draft intercept, draft slope)` in seconds (relative units before
        any timing): a round of γ >= 1 costs `verify intercept + draft intercept + (verify slope + draft slope)·γ`.

        Verifying γ >= 1 tokens is fitted apart from the plain one-token step: a multi-token verification can take
        another attention path (`budgetdraft_sdpa` attends to the past and the block separately), so the cost
        jumps from γ = 0 to γ = 1 more than it grows after."""
        if self.verify.count == 0:
            intercept = self.ar_step or 1.0
            slope = self.prior_verify_slope * intercept
        else:
            intercept, slope = self.verify.coefficients()
        ar_step = self.ar_step if self.ar_step is not None else intercept
        if self.draft.count == 0:
            draft_intercept, draft_slope = 0.0, self.prior_draft_ratio * ar_step
        else:
            draft_intercept, draft_slope = self.draft.coefficients()
        return ar_step, intercept, slope, draft_intercept, draft_slope

    def expected_rates(self, optimism: float = 0.0) -> list[float]:
        """Expected tokens per second for γ = 0..maximum (`optimism`: see `acceptance`)."""
        ar_step, intercept, slope, draft_intercept, draft_slope = self.costs()
        rates, tokens, survive = [1.0 / ar_step], 1.0, 1.0
        for gamma, rate in enumerate(self.acceptance(optimism), start=1):
            survive *= rate
            tokens += survive
            rates.append(tokens / (intercept + draft_intercept + (slope + draft_slope) * gamma))
        return rates

    # -- policy --------------------------------------------------------------------------------------------------
    def next_length(self) -> int:
        if self.ar_step is None and self.rounds >= 2:
            return (
                0  # one plain AR step early on: what drafting is compared with must be measured, not assumed
            )
        rates = self.expected_rates()
        best = max(range(len(rates)), key=rates.__getitem__)
        if best > 0 and rates[best] < (1 + self.switch_margin) * rates[0]:
            best = 0  # a predicted gain inside the estimates' noise is not worth a drafting round
        if best > 0 and self.drafting_rounds_in_a_row >= self.remeasure_after:
            self.remeasure_after = min(2 * self.remeasure_after, MOST_ROUNDS_BETWEEN_CHECKS)
            return 0  # re-measure the AR step drafting is compared with
        if best > 0:
            self.probe_after = FIRST_PROBE_AFTER  # drafting pays again: probe soon after the next fallback
            return best
        # a close call: drafting may still pay, were its acceptance one standard deviation above the estimate
        hopeful = self.expected_rates(optimism=1.0)
        drafting = max(range(1, len(hopeful)), key=hopeful.__getitem__)
        close = hopeful[drafting] >= (1 - self.close_call) * rates[0]
        if self.ar_rounds_in_a_row >= (self.close_probe_after if close else self.probe_after):
            if not close:
                self.probe_after = min(2 * self.probe_after, MOST_ROUNDS_BETWEEN_CHECKS)
            self.ar_rounds_in_a_row = 0
            return drafting
        return 0

    def update(self, drafted: int, accepted, draft_seconds: float, verify_seconds: float) -> None:
        """`accepted`: draft tokens kept (one sequence; a batch has `RowDraftLength`)."""
        self.rounds += 1
        self.ar_rounds_in_a_row = self.ar_rounds_in_a_row + 1 if drafted == 0 else 0
        self.drafting_rounds_in_a_row = self.drafting_rounds_in_a_row + 1 if drafted else 0
        if drafted:
            kept = int(accepted)
            for k in range(self.maximum):
                self.accepted[k] *= self.decay
                self.reached[k] *= self.decay
            for k in range(min(drafted, kept + 1)):  # positions 0..kept were reached
                self.reached[k] += 1.0
                self.accepted[k] += 1.0 if k < kept else 0.0
        if self.rounds == 1 or not (math.isfinite(verify_seconds) and verify_seconds > 0):
            return  # the first round holds the target's and the drafter's prefills
        if not drafted:
            self.ar_times = [*self.ar_times, verify_seconds][-self.ar_samples :]
            return
        if self.ar_step is None:
            return  # the first drafting round runs every path cold; the AR step it needs is not measured yet
        self.verify.add(float(drafted), min(verify_seconds, (drafted + 1) * self.ar_step))
        if math.isfinite(draft_seconds) and draft_seconds >= 0:
            self.draft.add(float(drafted), min(draft_seconds, drafted * self.ar_step))
