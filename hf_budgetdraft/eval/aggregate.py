"""Aggregate bench records.

- `summarize`: one row per cell (target × drafter × task × method × cache × policy × budget × context × γ), plus
  the same pooled over tasks (`task == "all"`): max greedy diff, acceptance with Wilson intervals (per draft
  position too), speed-ups with bootstrap intervals, median phase times, memory.
- `round_budget_rows`: the accepted length a cell's phase costs need for a 2× decode speed-up.
- `phase_fits`: `round = c + γ·t_draft_forward` (and the draft / verify phases alone) per method, budget and
  context, over every round of every γ, task and repeat (each call's first round, which holds the prefills, is
  left out).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from ..runs.intervals import acceptance_intervals, wilson_interval
from .metrics import bootstrap_ci, fit_round_time

CELL_KEYS = (
    "target",
    "drafter",
    "task",
    "method",
    "name",
    "label",
    "cache",
    "policy",
    "budget",
    "context_length",
    "gamma",
)
FIT_KEYS = ("target", "drafter", "method", "name", "cache", "policy", "budget", "context_length")
# paired per-repeat ratios summarised as a median with a bootstrap interval (`*_stock` / `*_growable` / `*_fast` /
# `*_static`: over those AR baselines, present when they ran)
SPEEDUP_KEYS = (
    "speedup_vs_ar",
    "decode_speedup_vs_ar",
    "speedup_vs_native",
    "speedup_vs_ar_stock",
    "decode_speedup_vs_ar_stock",
    "speedup_vs_ar_growable",
    "decode_speedup_vs_ar_growable",
    "speedup_vs_ar_fast",
    "decode_speedup_vs_ar_fast",
    "speedup_vs_ar_static",
    "decode_speedup_vs_ar_static",
)


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.median(values)) if values else None


def _speedup(ratios: list[float], draws: int, seed: int) -> tuple[float | None, float | None, float | None]:
    """Median of paired per-repeat ratios and its bootstrap 95% interval."""
    ratios = [r for r in ratios if r is not None]
    if not ratios:
        return None, None, None
    low, high = bootstrap_ci(ratios, np.median, draws=draws, seed=seed, vectorized=True)
    return float(np.median(ratios)), low, high


def summarize(records: list[dict], draws: int = 2000, seed: int = 0) -> list[dict]:
    """One row per cell and per cell pooled over tasks (`task == "all"`).

    Acceptance is pooled over samples from repeat 0 only: repeats of a deterministic run repeat the same rounds,
    so counting them again would shrink the intervals without new information (`acceptance_repeatable` says
    whether the repeats agreed). Speed-ups pool every (sample, repeat) pair.
    """
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for record in records:
        key = tuple(record[k] for k in CELL_KEYS)
        groups[key].append(record)
        groups[key[:2] + ("all",) + key[3:]].append(record)
    return [_cell_row(key, members, draws, seed) for key, members in groups.items()]


def _cell_row(key: tuple, members: list[dict], draws: int, seed: int) -> dict:
    """The summary row of one cell's records."""
    row = dict(zip(CELL_KEYS, key, strict=True))
    first = [m for m in members if m["repeat"] == 0]
    speculative = members[0]["method"] != "ar"
    diffs = [m["diff_tokens"] for m in members]
    first_diffs = [m["first_diff"] for m in members if m["first_diff"] is not None]
    row.update(
        runs=len(members),
        diff_tokens_max=max(diffs),
        runs_with_diff=sum(d > 0 for d in diffs),
        first_diff_min=min(first_diffs) if first_diffs else None,
        new_tokens=members[0]["new_tokens"],
    )
    if speculative:
        row.update(_acceptance(first, members))
    for name in SPEEDUP_KEYS:
        point, low, high = _speedup([m.get(name) for m in members], draws, seed)
        row.update({name: point, f"{name}_low": low, f"{name}_high": high})
    row.update(_costs(first, members, speculative))
    return row


def _acceptance(first: list[dict], members: list[dict]) -> dict:
    """Acceptance of repeat 0's rounds (Wilson intervals, per draft position too) and whether repeats agreed."""
    accepted = sum(m["accepted_tokens"] for m in first)
    proposed = sum(m["proposed_tokens"] for m in first)
    rounds = sum(m["rounds"] for m in first)
    low, high = wilson_interval(accepted, proposed)
    depth = max((len(m["acceptance_per_position"]) for m in first), default=0)
    per_position = [[0, 0] for _ in range(depth)]
    for m in first:
        for k, (a, r) in enumerate(m["acceptance_per_position"]):
            per_position[k][0] += a
            per_position[k][1] += r
    by_unit = defaultdict(set)
    for m in members:
        by_unit[(m["task"], m["sample"])].add(tuple(m["accepted_per_round"]))
    return dict(
        rounds=rounds,
        proposed_tokens=proposed,
        accepted_tokens=accepted,
        acceptance_rate=accepted / proposed if proposed else None,
        acceptance_low=low if proposed else None,
        acceptance_high=high if proposed else None,
        mean_accepted_length=(accepted + rounds) / rounds if rounds else None,
        acceptance_per_position=acceptance_intervals([tuple(c) for c in per_position]),
        acceptance_repeatable=all(len(v) == 1 for v in by_unit.values()),
    )


def _costs(first: list[dict], members: list[dict], speculative: bool) -> dict:
    """Median throughput and phase times, the largest cache sizes and memory, the passkey answer rate."""
    answers = [m["answer_match"] for m in first if m["answer_match"] is not None]
    return dict(
        tokens_per_second=_median(m["tokens_per_second"] for m in members),
        decode_tokens_per_second=_median(m["decode_tokens_per_second"] for m in members),
        draft_ms_per_round=_median(m["draft_ms_per_round"] for m in members),
        verify_ms_per_round=_median(m["verify_ms_per_round"] for m in members),
        overhead_ms_per_run=_median(
            1e3 * m["overhead_seconds"] if m["overhead_seconds"] is not None else None for m in members
        ),
        ar_ms_per_token=(
            _median(1e3 / m["decode_tokens_per_second"] for m in members if m["decode_tokens_per_second"])
            if not speculative
            else None
        ),
        draft_cache_bytes=max(m["draft_cache_bytes"] for m in members),
        target_cache_bytes=max(m["target_cache_bytes"] for m in members),
        peak_rss_bytes=max((m["peak_rss_bytes"] or 0) for m in members) or None,
        cuda_peak_bytes=max((m["cuda_peak_bytes"] or 0) for m in members) or None,
        answer_match_rate=sum(answers) / len(answers) if answers else None,
    )


def round_budget_rows(pooled: list[dict]) -> list[dict]:
    """Per speculative cell (pooled over tasks): the accepted length its median phase costs need for a 2× decode
    speed-up over the AR baseline of the same target and context (stock AR where it ran, else AR), the speed-up
    those costs predict at the measured accepted length, and at full acceptance (γ + 1 tokens a round)."""
    baselines = {}
    for r in pooled:
        if r["method"] == "ar" and r["ar_ms_per_token"]:
            name = "stock AR" if r["label"] == "ar_stock" else "AR"
            key = (r["target"], r["context_length"])
            if name == "stock AR" or key not in baselines:
                baselines[key] = (name, r["ar_ms_per_token"])
    rows = []
    for r in pooled:
        baseline = baselines.get((r["target"], r["context_length"]))
        if r["method"] == "ar" or baseline is None or r.get("mean_accepted_length") is None:
            continue
        if r["draft_ms_per_round"] is None or r["verify_ms_per_round"] is None:
            continue
        name, ar_ms = baseline
        round_ms = r["draft_ms_per_round"] + r["verify_ms_per_round"]
        rows.append(
            dict(
                label=r["label"],
                context_length=r["context_length"],
                baseline=name,
                ar_ms_per_token=ar_ms,
                round_ms=round_ms,
                mean_accepted_length=r["mean_accepted_length"],
                predicted_speedup=r["mean_accepted_length"] * ar_ms / round_ms,
                accepted_length_for_2x=2 * round_ms / ar_ms,
                full_acceptance_speedup=(r["gamma"] + 1) * ar_ms / round_ms,
            )
        )
    return rows


def phase_fits(records: list[dict]) -> list[dict]:
    """Least-squares cost model per (target, drafter, method, cache, policy, budget, context) over its rounds."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for record in records:
        if record["method"] != "ar":
            groups[tuple(record[k] for k in FIT_KEYS)].append(record)
    rows = []
    for key, members in groups.items():
        proposed, draft, verify = [], [], []
        for m in members:  # each call's first round holds the prefills: left out
            proposed += m["proposed_per_round"][1:]
            draft += m["draft_seconds_per_round"][1:]
            verify += m["verify_seconds_per_round"][1:]
        row = dict(zip(FIT_KEYS, key, strict=True))
        row["label"] = members[0]["label"].split(" γ=")[0]
        row["gammas"] = sorted({m["gamma"] for m in members})
        try:
            fits = fit_round_time(proposed, draft, verify)
        except ValueError as error:
            reason = str(error)
            if key[FIT_KEYS.index("method")] == "mtp":
                reason = (
                    "MTP drafts num_mtp_layers tokens every round, so γ does not vary; the per-depth costs are "
                    "measured by benchmarks/mtp_cost.py"
                )
            row.update(fit=None, reason=reason, n=len(proposed))
        else:
            row.update(fit={name: fit.as_dict() for name, fit in fits.items()}, reason=None, n=len(proposed))
        rows.append(row)
    return rows
