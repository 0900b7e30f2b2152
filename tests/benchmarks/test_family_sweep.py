"""`benchmarks/family_sweep.py`: each family in its own process, judged against its own greedy output and stock
assisted generation; the verdicts and the table."""

import json

import pytest
from repo_paths import load_benchmark

sweep = load_benchmark("family_sweep")


def test_three_families_each_in_a_process(tmp_path):
    sweep.main(["--families", "llama", "nanochat", "llava", "--out", str(tmp_path / "fs")])
    result = json.loads((tmp_path / "fs.json").read_text())
    assert [row["family"] for row in result["rows"]] == ["llama", "nanochat", "llava"]
    assert [row["kind"] for row in result["rows"]] == ["causal", "causal", "image-text-to-text"]
    assert all(sweep.verdict(row) == "identical" and row["stock"] == "identical" for row in result["rows"])
    drafted = 0
    for row in result["rows"]:  # the target's copy, reading every key, accepts each draft on both storages
        assert set(row["self_draft"]) == {"dynamic", "static"} and not sweep.drafts_short(row)
        accepted, proposed = map(int, row["self_draft"]["static"].split("/"))
        assert accepted == proposed
        drafted += proposed
        assert row["traced_step"] == "same"  # the step traced as CUDA compiles it drafts as the eager one
    assert drafted > 0
    table = (tmp_path / "fs.md").read_text()
    assert "2 causal-LM and 1 image-text-to-text families" in table
    assert "| nanochat | identical |" in table and "| llava (image-text-to-text) | identical |" in table
    assert "on a wrapping sink_window ring: 0 families drafted otherwise." in table


@pytest.mark.parametrize("family", ["llava", "qwen2_5_vl", "gemma3"])
def test_a_multimodal_family_is_built_small(family):
    """Its text model at the shared sizes, its vision tower at a token size (Qwen2.5-VL's rotary sections rescaled to
    the small heads, Gemma 3's layer pattern derived again for two layers)."""
    config = sweep._config(family)
    assert config.get_text_config().hidden_size == sweep.SIZES["hidden_size"]
    assert config.get_text_config().num_hidden_layers == sweep.SIZES["num_hidden_layers"]
    assert config.vision_config.num_hidden_layers == 1 or getattr(config.vision_config, "depth", None) == 1


def test_verdicts():
    built = {"family": "x", "built": "yes", "stock": "identical"}
    assert sweep.verdict({**built, "budgeted": "identical", "sink_window": "differs"}) == "differs"
    assert sweep.verdict({**built, "budgeted": "fails: E", "sink_window": "identical"}) == "fails"
    stock_fails = {**built, "stock": "fails: E", "budgeted": "fails: E", "sink_window": "fails: E"}
    assert sweep.verdict(stock_fails) == "fails (stock too)"
    assert sweep.verdict({**built, "budgeted": "refused: r", "sink_window": "refused: r"}) == "refused"
    assert sweep.verdict({"family": "x", "built": "TypeError: sizes"}) == "not built"


def test_a_copy_that_drafts_short_is_named():
    """A storage on which the copy accepted fewer drafts than it proposed is listed; refusals and full counts are not."""
    row = {"family": "x", "built": "yes", "self_draft": {"dynamic": "12/12", "static": "6/11"}}
    assert sweep.drafts_short(row) == ["static"]
    refused = {"family": "y", "built": "yes", "self_draft": {"dynamic": "8/8", "static": "refused: bias"}}
    assert sweep.drafts_short(refused) == []
    assert "1 families accepted fewer drafts than proposed: x (static)." in sweep._short_line([row, refused])


def test_a_traced_step_that_drafts_otherwise_is_named():
    rows = [
        {"family": "x", "traced_step": "differs (eager 9/20, traced 5/20)"},
        {"family": "y", "traced_step": "same"},
    ]
    rows.append({"family": "z", "traced_step": "not compiled: the drafter's layers copy their keys"})
    assert sweep._traced_line(rows).endswith("1 families drafted otherwise: x.")


def test_an_unknown_family_is_named():
    with pytest.raises(SystemExit):
        sweep.main(["--families", "no_such_model"])
