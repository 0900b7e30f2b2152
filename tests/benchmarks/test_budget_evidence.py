"""`benchmarks/budget_evidence.py` on the far-context tasks, a tiny run: the table has a row per task, context,
drafter and cache, and a target read as its own drafter on a full cache agrees with itself on every token."""

import importlib.util
import json
import sys

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


def test_a_tiny_run_on_the_far_context_tasks(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(DEMO_DIR / "tokenizer", local_files_only=True)
    torch.manual_seed(0)
    target = Glm4MoeForCausalLM(target_config(tokenizer, 2048, hidden=64, layers=2, heads=2)).eval()
    target.save_pretrained(tmp_path / "target")
    out = tmp_path / "evidence"
    args = ["--target", str(tmp_path / "target"), "--only", "target", "base", "--tasks", "copy", "retrieval"]
    args += ["--contexts", "512", "--budgets", "64", "--prompts", "2", "--threads", "1", "--out", str(out)]
    args += ["--bootstrap-draws", "50"]
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
    table = out.with_suffix(".md").read_text()
    assert table.count("\n| copy |") == 4 and table.count("\n| retrieval |") == 4
