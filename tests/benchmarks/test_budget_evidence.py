"""`benchmarks/budget_evidence.py` on the far-context tasks, a tiny run: the table has a row per task, context,
drafter and cache, a target read as its own drafter on a full cache agrees with itself on every token, and the
one-liner's timed calls reproduce plain AR's output."""

import json
import re

import pytest
import torch
from repo_paths import load_benchmark
from train_target import target_config
from transformers import AutoTokenizer, Glm4MoeForCausalLM

from hf_budgetdraft.demo.models import DEMO_DIR


def save_tiny_target(folder):
    """A random 2-layer far-target-shaped model (GLM-4, the demo tokenizer, 32-channel heads) saved to `folder`."""
    tokenizer = AutoTokenizer.from_pretrained(DEMO_DIR / "tokenizer", local_files_only=True)
    torch.manual_seed(0)
    Glm4MoeForCausalLM(target_config(tokenizer, 2048, hidden=64, layers=2, heads=2)).eval().save_pretrained(
        folder
    )


@pytest.mark.parametrize("policy", ["chunk", "snapkv"])  # snapkv scores with the prefill's queries
def test_a_tiny_run_on_the_far_context_tasks(tmp_path, policy):
    save_tiny_target(tmp_path / "target")
    out = tmp_path / "evidence"
    args = ["--target", str(tmp_path / "target"), "--only", "target", "base", "--tasks", "copy", "retrieval"]
    args += ["--contexts", "512", "--budgets", "64", "--prompts", "2", "--threads", "1", "--out", str(out)]
    args += ["--bootstrap-draws", "50", "--speed-prompts", "1", "--speed-tokens", "8", "--policy", policy]
    args += ["--roles", "base=base", "budgetdraft=target", "lambda0=base", "--goal-budgets", "64"]
    load_benchmark("budget_evidence").main(args)
    report = json.loads(out.with_suffix(".json").read_text())
    results = report["results"]
    assert re.fullmatch(r"[0-9a-f]{40}", report["meta"]["commit"])  # the tree the figures came from
    assert [(g["task"], g["budget"]) for g in report["goals"]] == [("copy", 64), ("retrieval", 64)]
    for row in results:  # the goals' paired intervals read each cell's prompts in the same order
        assert len(row["per_prompt_tokens_per_round"]) == 2
    cells = {(r["task"], r["drafter"], r["cache"]) for r in results}
    assert cells == {
        (t, d, c) for t in ("copy", "retrieval") for d in ("target", "base") for c in ("full", "B=64")
    }
    for row in results:
        assert row["prompts"] == 2 and 0.0 <= row["agreement"] <= 1.0
        if row["drafter"] == "target" and row["cache"] == "full":
            assert row["agreement"] == 1.0  # the target's own full-cache forward predicts its own answer
    assert all(row["answer_tokens"] == 96 for row in results if row["task"] == "copy")
    for row in results:  # a copy probe's passage, kept in part by a budget of 64 of ~512 tokens
        if row["task"] == "copy" and row["cache"] == "B=64":
            assert 0.0 <= row["needle_share"] < 1.0 and row["needle_kept"] == 0.0
        else:
            assert "needle_share" not in row
    for row in results:  # the one-liner timed on the first prompt: lossless against plain AR on every cache
        assert row["speed_prompts"] == 1 and row["identical"] == 1.0 and row["speedup"] > 0
    table = out.with_suffix(".md").read_text()
    assert "| one-liner speed-up | identical |" in table and f"policy `{policy}`" in table
    assert table.count("\n| copy |") == 5 and table.count("\n| retrieval |") == 5  # and a goals row each
    assert "## BudgetDraft's claim as goals" in table


def test_each_one_liner_call_is_compared_with_the_ar_of_its_own_moment(monkeypatch):
    """The machine's AR speed drifts; every one-liner call is divided by the mean of the AR calls just before and
    after it. Fake calls whose speeds all double from one call to the next give every one-liner call the same ratio to
    the AR around it (compared with the first and last AR of the prompt instead, they would range over 4x)."""
    load_benchmark("budget_evidence")  # puts benchmarks/ on the path
    import one_liner_speed

    calls = []

    def fake_timed_generate(target, prompt, new_tokens, **kwargs):
        rate = (
            100.0 * 2 ** len(calls) * (1.5 if kwargs else 1.0)
        )  # a one-liner call 1.5x the AR of its moment
        calls.append(kwargs)
        stats = type("Stats", (), {"rounds": 0, "mean_accepted_length": None, "ar_rounds": 0})()
        run = type("Run", (), {"decode_tokens_per_second": rate, "tokens_per_second": rate})()
        run.new_ids, run.stats = torch.arange(new_tokens), stats
        return run

    monkeypatch.setattr(one_liner_speed, "timed_generate", fake_timed_generate)
    drafters = {"a": object(), "b": object()}
    speeds = one_liner_speed.paired_speeds(None, drafters, torch.zeros(1, 16, dtype=torch.long), 4, [None, 8])
    assert [bool(kwargs) for kwargs in calls] == [False, True, False, True, False, True, False, True, False]
    # call i runs at 1.5 * 100 * 2^(2i + 1), between AR calls at 100 * 2^(2i) and 100 * 2^(2i + 2)
    assert [round(row["speedup"], 6) for row in speeds.values()] == [round(1.5 * 2 / 2.5, 6)] * 4
    assert all(row["identical"] for row in speeds.values())


def test_a_policy_with_hyper_parameters(tmp_path, monkeypatch):
    """`--policy-kwargs` reaches the draft caches (and the one-liner's): dynamic on 4 of the drafter's 32 channels;
    a hyper-parameter the policy refuses fails before any model loads."""
    save_tiny_target(tmp_path / "target")
    out = tmp_path / "evidence"
    args = ["--target", str(tmp_path / "target"), "--only", "target", "--tasks", "copy", "--contexts", "512"]
    args += [
        "--budgets",
        "64",
        "--prompts",
        "1",
        "--threads",
        "1",
        "--bootstrap-draws",
        "20",
        "--out",
        str(out),
    ]
    args += ["--policy", "dynamic", "--speed-prompts", "1", "--speed-tokens", "8"]
    benchmark = load_benchmark("budget_evidence")
    from hf_budgetdraft.cache import selection

    built = []

    def spy(name, **kwargs):
        built.append((name, kwargs))
        return get_policy(name, **kwargs)

    get_policy = selection.get_policy
    monkeypatch.setattr(selection, "get_policy", spy)
    benchmark.main([*args, "--policy-kwargs", '{"components": 4}'])
    # every budgeted cache, the teacher-forced one and the one-liner's, was built with them
    assert built and all(call == ("dynamic", {"components": 4}) for call in built if call[0] == "dynamic")
    assert sum(call[0] == "dynamic" for call in built) >= 2
    results = json.loads(out.with_suffix(".json").read_text())["results"]
    assert {r["cache"] for r in results} == {"full", "B=64"} and all(r["identical"] == 1.0 for r in results)
    assert 'policy `dynamic` {"components": 4}' in out.with_suffix(".md").read_text()
    with pytest.raises(ValueError, match="components must be an int >= 0"):
        benchmark.main([*args, "--policy-kwargs", '{"components": -1}'])
