"""`benchmarks/provenance.py`: every benchmark's results say which commit, machine and libraries made them."""

import re

import pytest
import torch
import transformers
from repo_paths import BENCHMARKS, load_benchmark


def test_a_run_record_names_its_commit_machine_and_libraries():
    provenance = load_benchmark("provenance")
    record = provenance.run_record(3)
    assert re.fullmatch(r"[0-9a-f]{40}", record["commit"])  # the tests run in a git checkout
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", record["date"])
    assert record["threads"] == 3
    assert (record["torch"], record["transformers"]) == (torch.__version__, transformers.__version__)
    assert record["machine"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    text = provenance.run_text(record)
    assert f"commit {record['commit'][:7]}" in text and record["machine"]["cpu"] in text
    assert f"torch {torch.__version__}, transformers {transformers.__version__}" in text


def test_a_header_reads_a_record_made_outside_a_checkout_or_before_machines_were_recorded():
    provenance = load_benchmark("provenance")
    old = {"torch": "2.13.0+cpu", "transformers": "5.25.0", "date": "2026-12-01", "commit": None}
    assert provenance.run_text(old) == "torch 2.13.0+cpu, transformers 5.25.0, 2026-12-01"


@pytest.mark.parametrize("name", sorted(p.stem for p in BENCHMARKS.glob("*.py")))
def test_every_benchmark_script_imports(name):
    """Each script's imports resolve (its main runs only as a script); the measuring ones record their run."""
    module = load_benchmark(name, f"{name}_bench")
    if name not in ("provenance", "one_liner_speed", "budget_goals", "demo_table"):
        assert "run_record" in vars(module), f"benchmarks/{name}.py writes no run_record() in its results"
