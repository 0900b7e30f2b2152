"""`benchmarks/per_query_view.py`, tiny: both block sizes run, give one mask (checked inside), and fill the table."""

import importlib.util
import json
import sys

from repo_paths import REPO


def test_a_tiny_run_writes_its_table(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "per_query_view_bench", REPO / "benchmarks" / "per_query_view.py"
    )
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    spec.loader.exec_module(bench)
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
