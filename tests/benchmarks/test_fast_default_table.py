"""`benchmarks/fast_default.py`'s table: `identical` says True only where a run was compared with `ar_stock`."""

from repo_paths import load_benchmark

META = {
    "command": "c",
    "threads": 2,
    "new_tokens": 8,
    "repeats": 1,
    "torch": "t",
    "transformers": "x",
    "date": "d",
}


def record(row: str, identical, graphs=None) -> dict:
    return {"text": "play", "context": 64, "row": row, "identical": identical, "compiled": None,
            "verify_graphs_compiled": graphs}  # fmt: skip


def test_a_row_never_compared_with_stock_ar_is_not_checked_rather_than_identical():
    bench = load_benchmark("fast_default", "fast_default_bench")
    rows = {r["row"]: r for r in bench.summarise([record("oneliner", None), record("gamma6", None)])}
    assert rows["oneliner"]["identical"] is None
    assert "| not checked |" in bench.markdown(list(rows.values()), META)


def test_one_differing_run_makes_the_row_not_identical():
    bench = load_benchmark("fast_default", "fast_default_bench")
    rows = bench.summarise([record("oneliner", True), record("oneliner", False), record("gamma6", True)])
    assert [r["identical"] for r in rows] == [False, True]


def test_verification_graphs_compiled_in_timed_calls_are_reported():
    bench = load_benchmark("fast_default", "fast_default_bench")
    rows = bench.summarise([record("device_round+compile", True, 0), record("device_round+compile", True, 2)])
    assert rows[0]["verify_graphs_compiled_timed"] == 2
    assert "device_round+compile at 64 (play): 2." in bench.markdown(rows, META)
