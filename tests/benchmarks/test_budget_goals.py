"""`benchmarks/budget_goals.py`: BudgetDraft's claim judged from per-prompt tokens a round with paired intervals,
each goal met, missed or open (its interval straddling the threshold)."""

import json

import numpy as np
import pytest
from repo_paths import load_benchmark

goals_module = load_benchmark("budget_goals")
ROLES = {"base": "base", "budgetdraft": "bd", "lambda0": "l0"}


def rows(per_prompt: dict[tuple[str, str], list[float]], task="copy", context=16384) -> list[dict]:
    return [
        {"task": task, "context": context, "drafter": d, "cache": c, "per_prompt_tokens_per_round": v}
        for (d, c), v in per_prompt.items()
    ]


def test_the_ratio_pairs_prompts():
    """Prompts differ 10-fold in how much they draft, but every budgeted figure is half its full-cache one: the
    paired interval is tight around 0.5 (resampled apart, the prompts' spread would make it wide)."""
    rng = np.random.default_rng(0)
    full = list(rng.uniform(1.0, 10.0, size=30))
    half = [value / 2 for value in full]
    ratio = goals_module.ratio_of_means(half, full, draws=500)
    assert ratio["ratio"] == pytest.approx(0.5)
    assert ratio["ci"] == pytest.approx([0.5, 0.5])
    noisy = [value * rng.uniform(0.4, 0.6) for value in full]
    low, high = goals_module.ratio_of_means(noisy, full, draws=500)["ci"]
    assert 0.4 < low < 0.5 < high < 0.6
    with pytest.raises(ValueError, match="same prompts"):
        goals_module.ratio_of_means(half[:-1], full, draws=10)


@pytest.mark.parametrize(
    "ci, at_most, expected",
    [
        ([0.95, 1.1], False, "met"),
        ([0.7, 0.85], False, "missed"),
        ([0.85, 0.95], False, "open (met)"),
        ([0.6, 0.7], True, "met"),
        ([0.8, 0.9], True, "missed"),
        ([0.7, 0.8], True, "open (missed)"),
    ],
)
def test_a_verdict_reads_the_whole_interval(ci, at_most, expected):
    point = 0.91 if expected == "open (met)" else (0.78 if expected == "open (missed)" else sum(ci) / 2)
    assert goals_module.verdict({"ratio": point, "ci": ci}, 0.9 if not at_most else 0.75, at_most) == expected


def test_the_claim_met_and_missed():
    """A base drafter that halves under the budget, a BudgetDraft drafter that keeps 95% of a full-cache figure
    like base's, λ = 0 between them: every goal met. Swap the two fine-tunes and the last two fail."""
    full = [4.0, 6.0, 5.0, 3.0, 7.0, 5.5, 4.5, 6.5]
    scale = {"base": 0.5, "bd": 0.95, "l0": 0.7}
    per_prompt = {}
    for name, keep in scale.items():
        per_prompt[name, "full"] = full
        per_prompt[name, "B=256"] = [value * keep for value in full]
    (record,) = goals_module.goals(rows(per_prompt), ROLES, draws=200, budgets=(256, 512))
    assert (record["task"], record["context"], record["budget"]) == ("copy", 16384, 256)
    assert record["base_keeps"]["ratio"] == pytest.approx(0.5)
    assert record["budgetdraft_over_base"]["ratio"] == pytest.approx(1.9)
    assert set(record["verdicts"].values()) == {"met"}
    swapped = goals_module.goals(rows(per_prompt), {**ROLES, "budgetdraft": "l0", "lambda0": "bd"}, draws=200)
    verdicts = swapped[0]["verdicts"]
    assert verdicts["BudgetDraft keeps >= 90%"] == "missed" and verdicts["λ = 0 in between"] == "missed"
    table = goals_module.markdown(swapped, ROLES)
    assert "| copy | 16384 | 256 | 0.50 [0.50, 0.50] met |" in table


def test_bad_inputs_say_what_is_wrong():
    per_prompt = {(name, cache): [1.0, 2.0] for name in ROLES.values() for cache in ("full", "B=256")}
    with pytest.raises(ValueError, match="missing"):
        goals_module.goals(rows(per_prompt), {"base": "base"})
    with pytest.raises(ValueError, match="lack"):
        goals_module.goals(rows(per_prompt), {**ROLES, "lambda0": "nobody"})
    old = rows(per_prompt)
    del old[0]["per_prompt_tokens_per_round"]
    with pytest.raises(ValueError, match="rerun budget_evidence"):
        goals_module.goals(old, ROLES)
    with pytest.raises(ValueError, match="ROLE=DRAFTER"):
        goals_module.parse_roles(["teacher=x"])


def test_compare_two_drafters_cell_by_cell(tmp_path, capsys):
    full = [4.0, 6.0, 5.0, 3.0, 7.0, 5.5, 4.5, 6.5]
    per_prompt = {
        ("a", "full"): full,
        ("a", "B=256"): [value * 1.1 for value in full],
        ("b", "full"): full,
        ("b", "B=256"): full,
        ("c", "B=512"): full,  # no cell shared with a: left out
    }
    records = goals_module.compare(rows(per_prompt), "a", "b", draws=200)
    assert [(r["cache"], round(r["ratio"], 3)) for r in records] == [("B=256", 1.1), ("full", 1.0)]
    table = goals_module.compare_markdown(records, "a", "b")
    assert "| copy | 16384 | 1.00 [1.00, 1.00] | 1.10 [1.10, 1.10] > |" in table
    with pytest.raises(ValueError, match="no cell holds both"):
        goals_module.compare(rows(per_prompt), "a", "nobody", draws=10)
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"results": rows(per_prompt)}))
    goals_module.main([str(results), "--compare", "a/b", "--bootstrap-draws", "50"])
    assert "`a` / `b`" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        goals_module.main([str(results)])  # neither --roles nor --compare
