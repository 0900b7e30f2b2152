"""`benchmarks/several_samples.py`, tiny: every variant returns its samples, and the table is filled."""

import json

from repo_paths import load_benchmark


def test_a_tiny_run_writes_its_table(tmp_path):
    bench = load_benchmark("several_samples", "several_samples_bench")
    sizes = ["--context-length", "300", "--samples", "3", "--new-tokens", "6", "--repeats", "2"]
    bench.main(["--threads", "1", *sizes, "--out", str(tmp_path / "ss")])
    result = json.loads((tmp_path / "ss.json").read_text())
    assert len(result["rows"]) == 2 and result["meta"]["samples"] == 3
    assert result["summary"]["ar_sequential"]["speed_vs_ar_sequential"] == 1.0
    assert "| one_liner_continued |" in (tmp_path / "ss.md").read_text()
