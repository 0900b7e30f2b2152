"""`benchmarks/continued_cache.py`, tiny: every call continues (or re-reads) the document, gives AR's output, and
fills the table."""

import json

from repo_paths import load_benchmark


def test_a_tiny_run_writes_its_table(tmp_path):
    bench = load_benchmark("continued_cache", "continued_cache_bench")
    sizes = ["--context-length", "300", "--questions", "2", "--new-tokens", "6", "--repeats", "1"]
    bench.main(["--threads", "1", *sizes, "--out", str(tmp_path / "cc")])
    result = json.loads((tmp_path / "cc.json").read_text())
    assert result["summary"]["identical"] and len(result["rows"]) == 2
    assert result["meta"]["context_length"] == 300
    assert "| one_liner_reread |" in (tmp_path / "cc.md").read_text()


def test_a_tiny_sampled_run_writes_its_table(tmp_path):
    bench = load_benchmark("continued_cache", "continued_cache_bench")
    sizes = ["--context-length", "300", "--questions", "2", "--new-tokens", "6", "--repeats", "1"]
    bench.main(["--threads", "1", *sizes, "--temperature", "0.8", "--out", str(tmp_path / "cc")])
    result = json.loads((tmp_path / "cc.json").read_text())
    assert result["summary"]["identical"] is None and result["meta"]["temperature"] == 0.8
    assert all(row["one_liner"]["tokens_per_round"] >= 1 for row in result["rows"])
    assert "Sampling at temperature 0.8" in (tmp_path / "cc.md").read_text()


def test_documents_taken_in_turn(tmp_path):
    bench = load_benchmark("continued_cache", "continued_cache_bench")
    sizes = ["--context-length", "300", "--questions", "2", "--new-tokens", "6", "--repeats", "1"]
    bench.main(["--threads", "1", *sizes, "--documents", "2", "--out", str(tmp_path / "cc")])
    result = json.loads((tmp_path / "cc.json").read_text())
    assert result["summary"]["identical"] and [row["document"] for row in result["rows"]] == [0, 1, 0, 1]
    assert "2 documents taken in turn" in (tmp_path / "cc.md").read_text()
