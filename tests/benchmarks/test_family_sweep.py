"""`benchmarks/family_sweep.py`: each family in its own process, judged against its own greedy output and stock
assisted generation; the verdicts and the table."""

import json

import pytest
from repo_paths import load_benchmark

sweep = load_benchmark("family_sweep")


def test_two_families_each_in_a_process(tmp_path):
    sweep.main(["--families", "llama", "nanochat", "--out", str(tmp_path / "fs")])
    result = json.loads((tmp_path / "fs.json").read_text())
    assert [row["family"] for row in result["rows"]] == ["llama", "nanochat"]
    assert all(sweep.verdict(row) == "identical" and row["stock"] == "identical" for row in result["rows"])
    assert "| nanochat | identical |" in (tmp_path / "fs.md").read_text()


def test_verdicts():
    built = {"family": "x", "built": "yes", "stock": "identical"}
    assert sweep.verdict({**built, "budgeted": "identical", "sink_window": "differs"}) == "differs"
    assert sweep.verdict({**built, "budgeted": "fails: E", "sink_window": "identical"}) == "fails"
    stock_fails = {**built, "stock": "fails: E", "budgeted": "fails: E", "sink_window": "fails: E"}
    assert sweep.verdict(stock_fails) == "fails (stock too)"
    assert sweep.verdict({**built, "budgeted": "refused: r", "sink_window": "refused: r"}) == "refused"
    assert sweep.verdict({"family": "x", "built": "TypeError: sizes"}) == "not built"


def test_an_unknown_family_is_named():
    with pytest.raises(SystemExit):
        sweep.main(["--families", "no_such_model"])
