"""`benchmarks/far_context_skill.py`, tiny: an induction oracle meets every goal, a random model none of the
far-context ones, and a run writes one table row per model and distance with the bundled target as reference."""

import argparse
import json

import torch
from repo_paths import load_benchmark
from train_target import target_config
from transformers import AutoTokenizer, Glm4MoeForCausalLM

from hf_budgetdraft.demo.models import DEMO_DIR
from hf_budgetdraft.eval.far_context import InductionOracle, held_out_sources


def test_an_induction_oracle_meets_the_goals_a_random_model_does_not():
    bench = load_benchmark("far_context_skill")
    tokenizer = AutoTokenizer.from_pretrained(DEMO_DIR / "tokenizer", local_files_only=True)
    args = argparse.Namespace(
        distances=[256], count=3, seed=0, bootstrap_draws=50, ppl_tokens=128, ppl_window=64
    )
    bench.GOAL_DISTANCE = 256
    sources = held_out_sources(tokenizer)
    oracle = bench.measure(InductionOracle(len(tokenizer)), tokenizer, sources, args)
    assert oracle["by_distance"][0]["copy"] == 1.0 and oracle["by_distance"][0]["retrieval"] == 1.0
    torch.manual_seed(0)
    random_model = Glm4MoeForCausalLM(target_config(tokenizer, 1024, hidden=64, layers=2, heads=2)).eval()
    chance = bench.measure(random_model, tokenizer, sources, args)
    assert chance["by_distance"][0]["copy"] < 0.2 and chance["by_distance"][0]["retrieval"] == 0.0
    assert list(bench.goals(oracle, chance["perplexity"]).values())[:2] == [True, True]
    assert bench.goals(chance, chance["perplexity"]) == {
        "copy >= 90% to 8K": False,
        "retrieval >= 50% at 8K": False,
        "perplexity <= bundled": True,
    }


def test_a_run_writes_a_row_per_model_and_distance(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(DEMO_DIR / "tokenizer", local_files_only=True)
    torch.manual_seed(0)
    Glm4MoeForCausalLM(target_config(tokenizer, 1024, hidden=64, layers=2, heads=2)).save_pretrained(
        tmp_path / "m"
    )
    out = tmp_path / "skill"
    load_benchmark("far_context_skill").main(
        [
            "--model",
            f"tiny={tmp_path / 'm'}",
            "--distances",
            "64",
            "128",
            "--count",
            "2",
            "--ppl-tokens",
            "128",
        ]
        + ["--ppl-window", "64", "--bootstrap-draws", "50", "--threads", "1", "--out", str(out)]
    )
    written = json.loads(out.with_suffix(".json").read_text())
    assert list(written["models"]) == ["bundled", "tiny"] and written["meta"]["threads"] == 1
    assert [r["distance"] for r in written["models"]["tiny"]["by_distance"]] == [64, 128]
    table = out.with_suffix(".md").read_text()
    assert table.count("| tiny | ") == 3 and table.count("| bundled | ") == 3  # two distances + the goals row
