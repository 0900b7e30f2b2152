"""`scripts/far_pair.py`, the far-context pair's one device run, at CPU-smoke size: every stage runs in its own
process, the fine-tunes differ only in the sparse-loss weight, what comes back fits the device tool's limits and
unpacks into models that load; a stage that fails stops the stages that need it and says so."""

import json
import subprocess
import sys

import far_pair
import far_target_data as data
import pytest
import torch
from repo_paths import SCRIPTS
from transformers import AutoModelForCausalLM


def run_pair(*args, timeout=600):
    command = [sys.executable, str(SCRIPTS / "far_pair.py"), "run", "--cpu-smoke", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


def test_one_run_trains_the_pair_and_packs_it_for_the_trip_back(tokenizer, corpus, tmp_path):
    data.prepare(tokenizer, corpus, tmp_path / "data")
    out, work = tmp_path / "out", tmp_path / "work"
    done = run_pair(
        "--data", str(tmp_path / "data"), "--out", str(out), "--work", str(work), "--commit", "abc"
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["commit"] == "abc"
    stages = summary["stages"]
    assert list(stages) == ["target", "drafter", "documents", "finetune_dual", "finetune_lambda0"]
    assert all(stage["status"] == "ok" for stage in stages.values())
    dual, ablation = (stages[name]["command"].split() for name in ("finetune_dual", "finetune_lambda0"))
    differing = [(a, b) for a, b in zip(dual, ablation, strict=True) if a != b]
    assert differing == [("0.5", "0.0"), (str(work / "finetune_dual"), str(work / "finetune_lambda0"))]
    parts = sorted(out.glob("far_pair.tar.*"))
    assert [p.name for p in parts] == summary["parts"] and 1 <= len(parts) <= 7
    assert all(p.stat().st_size <= far_pair.PART_BYTES for p in parts)

    unpacked = far_pair.unpack(out, tmp_path / "back")
    assert unpacked == ["base", "budgetdraft", "lambda0", "logs", "target"]
    target = AutoModelForCausalLM.from_pretrained(tmp_path / "back" / "target", use_safetensors=True)
    assert target.dtype == torch.bfloat16  # the size the device tool brings back
    for name, weight in (("budgetdraft", 0.5), ("lambda0", 0.0)):
        drafter = AutoModelForCausalLM.from_pretrained(tmp_path / "back" / name, use_safetensors=True)
        assert drafter(torch.tensor([[1, 2, 3]])).logits.shape[-1] == len(tokenizer)
        assert (
            json.loads((tmp_path / "back" / name / "budgetdraft.json").read_text())["sparse_loss_weight"]
            == weight
        )
    logs = {p.name for p in (tmp_path / "back" / "logs").iterdir()}
    assert {
        "target.log",
        "drafter.log",
        "documents.log",
        "target_log.jsonl",
        "drafts_induction.jsonl",
    } <= logs


def test_a_failed_stage_stops_what_needs_it(tmp_path):
    done = run_pair(
        "--data", str(tmp_path / "missing"), "--out", str(tmp_path / "out"), "--work", str(tmp_path)
    )
    assert done.returncode == 1
    stages = json.loads((tmp_path / "out" / "summary.json").read_text())["stages"]
    assert stages["target"]["status"].startswith("failed") and stages["documents"]["status"].startswith(
        "failed"
    )
    assert "drafter" not in stages and "finetune_dual" not in stages
    assert far_pair.unpack(tmp_path / "out", tmp_path / "back") == ["logs"]  # the logs still come back


def test_bad_arguments_are_refused(tmp_path):
    for bad in (
        ["--minutes", "0"],
        ["--budgets", "256", "512", "--budget-weights", "1"],
        ["--policy", "nope"],
    ):
        with pytest.raises(SystemExit):
            far_pair.parse(["run", "--out", str(tmp_path), *bad])
    with pytest.raises(ValueError, match="no far_pair.tar.NNN parts"):
        far_pair.unpack(tmp_path, tmp_path / "into")


def test_the_fine_tunes_train_on_the_chosen_views(tmp_path):
    args = far_pair.parse(["run", "--out", str(tmp_path), "--policy", "dynamic"])
    for name, weight in (("finetune_dual", 0.5), ("finetune_lambda0", 0.0)):
        command = far_pair.finetune_command(args, tmp_path, name, weight)
        assert command[command.index("--policy") + 1] == "dynamic"
