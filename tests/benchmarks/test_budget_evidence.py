"""`benchmarks/budget_evidence.py` on the far-context tasks, a tiny run: the table has a row per task, context,
drafter and cache, a target read as its own drafter on a full cache agrees with itself on every token, and the
one-liner's timed calls reproduce plain AR's output."""

import importlib.util
import json
import sys

import pytest
import torch
from repo_paths import REPO as ROOT
from train_target import target_config
from transformers import AutoTokenizer, Glm4MoeForCausalLM

from hf_budgetdraft.demo.models import DEMO_DIR


def load_benchmark():
    spec = importlib.util.spec_from_file_location(
        "budget_evidence", ROOT / "benchmarks" / "budget_evidence.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("policy", ["chunk", "snapkv"])  # snapkv scores with the prefill's queries
def test_a_tiny_run_on_the_far_context_tasks(tmp_path, policy):
    tokenizer = AutoTokenizer.from_pretrained(DEMO_DIR / "tokenizer", local_files_only=True)
    torch.manual_seed(0)
    target = Glm4MoeForCausalLM(target_config(tokenizer, 2048, hidden=64, layers=2, heads=2)).eval()
    target.save_pretrained(tmp_path / "target")
    out = tmp_path / "evidence"
    args = ["--target", str(tmp_path / "target"), "--only", "target", "base", "--tasks", "copy", "retrieval"]
    args += ["--contexts", "512", "--budgets", "64", "--prompts", "2", "--threads", "1", "--out", str(out)]
    args += ["--bootstrap-draws", "50", "--speed-prompts", "1", "--speed-tokens", "8", "--policy", policy]
    load_benchmark().main(args)
    results = json.loads(out.with_suffix(".json").read_text())["results"]
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
    assert table.count("\n| copy |") == 4 and table.count("\n| retrieval |") == 4
