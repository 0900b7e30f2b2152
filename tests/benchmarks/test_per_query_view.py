"""`benchmarks/per_query_view.py`, tiny: both block sizes run, give one mask (checked inside), and fill the table."""

import json

from repo_paths import load_benchmark


def test_a_tiny_run_writes_its_table(tmp_path):
    bench = load_benchmark("per_query_view", "per_query_view_bench")
    sizes = [
        "--prompts",
        "96",
        "--continuation",
        "5",
        "--head-dims",
        "16",
        "--budget",
        "32",
        "--repeats",
        "1",
    ]
    bench.main(["--threads", "1", *sizes, "--output-dir", str(tmp_path)])
    summary = json.loads((tmp_path / "per_query_view.json").read_text())
    (record,) = summary["records"]
    assert record["prompt"] == 96 and record["exact_scores"] and record["speedup_median"] > 0
    assert "| 96 | 16 | exact |" in (tmp_path / "per_query_view.md").read_text()
