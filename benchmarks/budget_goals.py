"""BudgetDraft's claim as goals with paired intervals, from `budget_evidence.py`'s per-prompt tokens a round.

The claim (BudgetDraft, arXiv 2606.00144): a drafter reading a sparse KV cache loses acceptance to the budget, and
one trained on sampled budgets with the dual loss wins it back. Read per (task, context, budget B), with three
drafters in roles (`base`: the drafter before fine-tuning; `budgetdraft`: fine-tuned with the dual loss; `lambda0`:
the same fine-tune without its sparse loss):

- `base loses >= 25%`: base's tokens a round at B over its own on the full cache, at most 0.75;
- `BudgetDraft keeps >= 90%`: the same ratio for the BudgetDraft drafter, at least 0.90;
- `BudgetDraft >= 1.2x base`: the two drafters' tokens a round at the same B, at least 1.2;
- `λ = 0 in between`: λ = 0 over base and BudgetDraft over λ = 0 at the same B, each at least 1.

Every figure is a ratio of means over the same prompts, its 95% interval a paired bootstrap (a prompt's values are
resampled together), so two drafters are compared on the prompts both drafted. A goal is `met` when its whole
interval lies on the goal's side of the threshold, `missed` when it lies wholly on the other, and `open` when it
straddles the threshold (the point estimate's side in brackets): more prompts decide it.

    python benchmarks/budget_goals.py benchmarks/results/far_target/budget_goals_cpu.json \
        --roles base=base budgetdraft=budgetdraft lambda0=lambda0
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from hf_budgetdraft.eval.metrics import bootstrap_ci

ROLES = ("base", "budgetdraft", "lambda0")
GOAL_BUDGETS = (256, 512)  # the budgets the claim is read at


def ratio_of_means(numerators: list[float], denominators: list[float], draws: int) -> dict:
    """`mean(numerators) / mean(denominators)` over paired prompts, with its paired bootstrap 95% interval."""
    if len(numerators) != len(denominators) or not numerators:
        raise ValueError(
            f"a paired ratio needs the same prompts on both sides, got {len(numerators)} and {len(denominators)}"
        )
    pairs = np.column_stack([numerators, denominators])  # (n, 2)

    def statistic(resamples: np.ndarray, axis: int) -> np.ndarray:
        means = resamples.mean(axis=axis)  # (draws, 2)
        return means[..., 0] / means[..., 1]

    low, high = bootstrap_ci(pairs, statistic, draws=draws, vectorized=True)
    return {"ratio": float(np.mean(numerators) / np.mean(denominators)), "ci": [float(low), float(high)]}


def verdict(ratio: dict, threshold: float, at_most: bool = False) -> str:
    """`met` / `missed` / `open (met)` / `open (missed)`: where the interval lies against `threshold` (a goal of at
    least `threshold`, or at most with `at_most`)."""
    low, high = ratio["ci"]
    side = (lambda value: value <= threshold) if at_most else (lambda value: value >= threshold)
    if side(low) and side(high):
        return "met"
    if not side(low) and not side(high):
        return "missed"
    return f"open ({'met' if side(ratio['ratio']) else 'missed'})"


def _per_prompt(results: list[dict]) -> dict[tuple, list[float]]:
    table = {}
    for row in results:
        if "per_prompt_tokens_per_round" not in row:
            raise ValueError(
                f"the result row {row['task']}/{row['context']}/{row['drafter']}/{row['cache']} has no per-prompt "
                "tokens a round; rerun budget_evidence.py (rows written before the goals were added lack them)"
            )
        table[row["task"], row["context"], row["drafter"], row["cache"]] = row["per_prompt_tokens_per_round"]
    return table


def goals(results: list[dict], roles: dict[str, str], draws: int = 2000, budgets=GOAL_BUDGETS) -> list[dict]:
    """One record per (task, context, budget in `budgets` the results hold) with the four goals' ratios and
    verdicts; `roles` maps each of `ROLES` to a drafter name of the results."""
    missing = [role for role in ROLES if role not in roles]
    if missing:
        raise ValueError(f"roles must name a drafter for each of {ROLES}, missing {missing}; e.g. base=base")
    table = _per_prompt(results)
    drafters = {d for (_, _, d, _) in table}
    unknown = sorted(name for name in roles.values() if name not in drafters)
    if unknown:
        raise ValueError(
            f"roles name drafters the results lack: {unknown}; the results hold {sorted(drafters)}"
        )
    records = []
    for task, context in sorted({(t, c) for (t, c, _, _) in table}):
        cells = {key[2:]: values for key, values in table.items() if key[:2] == (task, context)}
        for budget in budgets:
            if (roles["base"], f"B={budget}") in cells:
                records.append(_record(cells, roles, draws, task, context, budget))
    return records


def _record(cells: dict, roles: dict[str, str], draws: int, task: str, context: int, budget: int) -> dict:
    """The goals at one (task, context, budget); `cells` maps `(drafter, cache)` to per-prompt tokens a round."""
    base, dual, ablation = (roles[role] for role in ROLES)
    cache = f"B={budget}"
    ratios = {
        "base_keeps": ratio_of_means(cells[base, cache], cells[base, "full"], draws),
        "budgetdraft_keeps": ratio_of_means(cells[dual, cache], cells[dual, "full"], draws),
        "budgetdraft_over_base": ratio_of_means(cells[dual, cache], cells[base, cache], draws),
        "lambda0_over_base": ratio_of_means(cells[ablation, cache], cells[base, cache], draws),
        "budgetdraft_over_lambda0": ratio_of_means(cells[dual, cache], cells[ablation, cache], draws),
    }
    verdicts = {
        "base loses >= 25%": verdict(ratios["base_keeps"], 0.75, at_most=True),
        "BudgetDraft keeps >= 90%": verdict(ratios["budgetdraft_keeps"], 0.90),
        "BudgetDraft >= 1.2x base": verdict(ratios["budgetdraft_over_base"], 1.2),
        "λ = 0 in between": _between(ratios),
    }
    return {"task": task, "context": context, "budget": budget, **ratios, "verdicts": verdicts}


def _between(ratios: dict) -> str:
    """Both `λ = 0 / base >= 1` and `BudgetDraft / λ = 0 >= 1`: met if both are, missed if either is."""
    parts = [verdict(ratios["lambda0_over_base"], 1.0), verdict(ratios["budgetdraft_over_lambda0"], 1.0)]
    if "missed" in parts:
        return "missed"
    if parts == ["met", "met"]:
        return "met"
    return "open (missed)" if any("missed" in part for part in parts) else "open (met)"


def markdown(records: list[dict], roles: dict[str, str]) -> str:
    """The goals section: one table row per (task, context, budget)."""
    named = ", ".join(f"{role} = `{roles[role]}`" for role in ROLES)
    head = (
        "## BudgetDraft's claim as goals\n\n"
        f"Drafters: {named}. Ratios of mean tokens a round over the same prompts, paired bootstrap 95% intervals; "
        "a goal is `met` / `missed` when its whole interval lies on one side of the threshold, `open` when it "
        "straddles it (the point estimate's side in brackets) (`benchmarks/budget_goals.py`).\n"
    )
    columns = [
        "task",
        "context",
        "B",
        "base keeps (<= 0.75)",
        "BudgetDraft keeps (>= 0.90)",
        "BudgetDraft / base (>= 1.2)",
        "λ = 0 / base",
        "BudgetDraft / λ = 0",
    ]
    lines = [head, "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in records:
        v = r["verdicts"]
        cells = [
            r["task"],
            str(r["context"]),
            str(r["budget"]),
            f"{_ratio(r['base_keeps'])} {v['base loses >= 25%']}",
            f"{_ratio(r['budgetdraft_keeps'])} {v['BudgetDraft keeps >= 90%']}",
            f"{_ratio(r['budgetdraft_over_base'])} {v['BudgetDraft >= 1.2x base']}",
            _ratio(r["lambda0_over_base"]),
            f"{_ratio(r['budgetdraft_over_lambda0'])} (in between: {v['λ = 0 in between']})",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def compare(results: list[dict], numerator: str, denominator: str, draws: int = 2000) -> list[dict]:
    """`numerator`'s tokens a round over `denominator`'s at every (task, context, cache) both drafted, each a
    paired ratio of means with its interval."""
    table = _per_prompt(results)
    records = []
    for (task, context, drafter, cache), values in sorted(table.items()):
        other = table.get((task, context, denominator, cache))
        if drafter == numerator and other is not None:
            ratio = ratio_of_means(values, other, draws)
            records.append({"task": task, "context": context, "cache": cache, **ratio})
    if not records:
        drafters = sorted({d for (_, _, d, _) in table})
        raise ValueError(
            f"--compare {numerator}/{denominator}: no cell holds both; the results hold drafters {drafters}"
        )
    return records


def compare_markdown(records: list[dict], numerator: str, denominator: str) -> str:
    """One row per (task, context): the ratio at each cache, 95% paired interval, `>` / `<` where it excludes 1."""
    caches = sorted(
        {r["cache"] for r in records}, key=lambda c: (c != "full", int(c[2:]) if c != "full" else 0)
    )
    rows = {}
    for r in records:
        mark = " >" if r["ci"][0] > 1 else " <" if r["ci"][1] < 1 else ""
        rows.setdefault((r["task"], r["context"]), {})[r["cache"]] = _ratio(r) + mark
    lines = [
        f"## `{numerator}` / `{denominator}`: tokens a round on the same prompts\n",
        "Ratios of means, paired bootstrap 95% intervals; `>` / `<`: the interval lies above / below 1.\n",
        "| task | context | " + " | ".join(caches) + " |",
        "|" + "---|" * (2 + len(caches)),
    ]
    for (task, context), cells in rows.items():
        lines.append(f"| {task} | {context} | " + " | ".join(cells.get(c, "") for c in caches) + " |")
    return "\n".join(lines) + "\n"


def _ratio(ratio: dict) -> str:
    return f"{ratio['ratio']:.2f} [{ratio['ci'][0]:.2f}, {ratio['ci'][1]:.2f}]"


def parse_roles(items: list[str]) -> dict[str, str]:
    """`["base=NAME", ...]` as `{role: drafter}`; each role one of `ROLES`."""
    roles = {}
    for item in items:
        role, _, name = item.partition("=")
        if role not in ROLES or not name:
            raise ValueError(f"--roles takes ROLE=DRAFTER with ROLE one of {ROLES}, got {item!r}")
        roles[role] = name
    return roles


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("results", type=Path, help="a budget_evidence.py JSON")
    parser.add_argument("--roles", nargs="+", help="base=NAME budgetdraft=NAME lambda0=NAME")
    parser.add_argument(
        "--compare", nargs="+", default=[], help="A/B: drafter A's tokens a round over B's in every cell"
    )
    parser.add_argument("--budgets", type=int, nargs="+", default=list(GOAL_BUDGETS))
    parser.add_argument("--bootstrap-draws", type=int, default=2000)
    args = parser.parse_args(argv)
    if not args.roles and not args.compare:
        parser.error("give --roles, --compare or both")
    results = json.loads(args.results.read_text())["results"]
    if args.roles:
        roles = parse_roles(args.roles)
        print(markdown(goals(results, roles, args.bootstrap_draws, args.budgets), roles))
    for pair in args.compare:
        numerator, _, denominator = pair.partition("/")
        if not numerator or not denominator:
            parser.error(f"--compare takes A/B (two drafter names), got {pair!r}")
        print(
            compare_markdown(
                compare(results, numerator, denominator, args.bootstrap_draws), numerator, denominator
            )
        )


if __name__ == "__main__":
    main()
