"""`scripts/gpu_round.py --cpu-smoke`: the GPU round's logic at tiny sizes on CPU, every part in its own process.

The GPU figures cannot be made here; this proves the prepared run goes end to end and writes what the GPU run will:
the commit in every JSON, the rows (a) ... (d0) with replayed acceptance per trace, the device round's record of
what ran, and the bundled pair's identity on every path."""

import importlib
import json
import subprocess
import sys

import pytest
import torch
from repo_paths import SCRIPTS
from tiny_models import model_pair, random_prompt
from torch_support import needs_traceable_transformers

SCRIPT = SCRIPTS / "gpu_round.py"


@needs_traceable_transformers
def test_cpu_smoke_runs_every_part_and_records_what_ran(tmp_path):
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path), "--commit", "abc123", "--cpu-smoke"],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    merged = json.loads((tmp_path / "gpu_round.json").read_text())
    assert done.returncode == 0 and merged["all_passed"], done.stdout[-3000:] + done.stderr[-3000:]
    assert merged["commit"] == "abc123" and set(merged["parts"]) == {
        "synthetic_160",
        "long",
        "real",
        "families",
    }
    for part in merged["parts"].values():
        assert part["commit"] == "abc123" and part["exit_code"] == 0 and not part["errors"]

    synthetic = merged["parts"]["synthetic_160"]["synthetic_160"]
    traces = set(synthetic["traces"])
    assert traces == {"licences (4K trace)", "king_john (4K trace)", "paper alpha=0.55 (8K)"}
    replayed = {
        f"{row} | {trace}" for row in ("c_stock_default", "c_stock_gamma", "d_oneliner") for trace in traces
    }
    assert set(synthetic["ratio_to_b"]) == replayed | {"a_plain", "b_static_compiled", "d0_oneliner_no_draft"}
    assert (
        synthetic["ratio_to_b"]["b_static_compiled"] == 1.0 and "replayed acceptance" in synthetic["replay"]
    )
    for key in replayed:
        if key.startswith("d_"):
            verify = synthetic["runtime"][key]["verify"]
            assert synthetic["runtime"][key]["loop"] == "device_round" and verify["compiled_calls"] > 0
            assert verify["new_shapes"] == verify["recompiles"] == 0  # compiled in the warm pass, never again
    # the warm pass's first call compiled the one-liner's graphs
    cold = synthetic["cold_runtime"]["d_oneliner"]
    assert cold["loop"] == "device_round" and cold["verify"]["new_shapes"] > 0
    assert cold["verify"]["cuda_graph_skips"] == 0 and synthetic["cuda_graph_skips_in_process"] >= 0
    assert set(synthetic["goals"]) == traces and synthetic["round"]["host_ms_per_drafting_round"] is not None
    attribution = synthetic["round"]["host_attribution"]  # a verification and draft steps a round, compiled
    assert attribution["dynamo_guard_check_calls_per_round"] >= 1
    assert attribution["compiled_regions_us_per_round"] > 0
    assert 0 <= synthetic["margins"]["smallest_top1_margin"] <= synthetic["margins"]["median_top1_margin"]
    assert synthetic["margins"]["median_top1_margin"] > 0

    long = merged["parts"]["long"]["long_224"]
    assert {k.split(" | ")[0] for k in long["ratio_to_b"]} == {"b_static_compiled", "d_oneliner"}

    real = merged["parts"]["real"]["real"]
    for dtype in ("float32", "bfloat16"):
        paths = real["identity"][dtype]
        rows = [row for name, row in paths.items() if name != "batch_of_4"]
        rows += paths["batch_of_4"].values()
        if dtype == "float32":
            assert all(row["diff_tokens"] == 0 for row in rows)
        else:  # a first divergence only at a near-tie (the script's BF16_MARGIN): bf16 rounds batches otherwise
            assert all(row["diff_tokens"] == 0 or abs(row["target_margin"]) <= 0.25 for row in rows)
        assert paths["device_round_sink_window_static"]["runtime"]["loop"] == "device_round"
        assert paths["transformers_loop_static"]["runtime"]["loop"] == "transformers"
        assert "oneliner_policy_dynamic" in paths
        assert paths["continued_cache"]["second_identical"]  # the drafter continuing its last prompt
    assert real["speed"]["runtime"]["loop"] == "device_round" and real["speed"]["d_over_b"] > 0

    families = merged["parts"]["families"]["families"]
    assert set(families) == {
        "gemma3_sliding", "cohere2_sliding", "mistral_all_sliding", "gemma4_kv_sharing", "device_round_sliding_drafter",
        "device_round_sliding_target",
    }  # fmt: skip
    for name, calls in families.items():
        first, second = (calls[f"call{k}"]["runtime"]["draft_step"] for k in range(2))
        assert all(call["diff_tokens"] == 0 for call in calls.values())
        assert first["graphs_compiled"] == 1 and second["graphs_compiled"] == 0
        assert first["eager_calls"] == second["eager_calls"] == 0
        if name.startswith("device_round"):  # the verification compiled on a Llama target, or on rings
            first_verify, second_verify = (calls[f"call{k}"]["runtime"]["verify"] for k in range(2))
            assert first_verify["new_shapes"] > 0 and second_verify["graphs_compiled"] == 0
            assert (first_verify["ring_layers"] > 0) == (name == "device_round_sliding_target")
        else:  # a copy reading every key
            assert all(call["accepted"] == call["proposed"] > 0 for call in calls.values())


@pytest.fixture
def rows(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    return importlib.import_module("gpu_round_rows")


@pytest.mark.parametrize("assisted", [False, True], ids=["plain", "stock_assisted"])
def test_decode_rate_times_one_call_from_its_first_streamed_tokens(rows, assisted, monkeypatch):
    clocks = []

    class Recorded(rows.FirstTokens):
        def __init__(self):
            super().__init__()
            clocks.append(self)

    monkeypatch.setattr(rows, "FirstTokens", Recorded)
    target, drafter = model_pair("llama")  # the drafter proposes 3 tokens a round
    prompt = random_prompt(24)
    kwargs = {"assistant_model": drafter} if assisted else {}
    rate, out, _ = rows.decode_rate(target, prompt, 12, kwargs, None, 0)
    (clock,) = clocks
    # the prompt's put, then the first token (a plain loop) or the first round's tokens (stock assisted)
    assert clock.puts >= 2 and clock.at is not None
    assert clock.tokens == 1 if not assisted else 1 <= clock.tokens <= 4
    assert rate > 0 and out.shape[1] == 24 + 12
    assert torch.equal(out, target.generate(prompt, do_sample=False, max_new_tokens=12))


def test_compiled_ran_needs_both_steps_to_have_run_not_only_planned(rows):
    verify = {"compiled_calls": 9, "failure": None}
    draft = {"compiled": True, "compiled_calls": 3, "failure": None}
    assert rows.compiled_steps_ran({"verify": verify, "draft_step": draft}, drafting_rounds=3)
    planned_only = {**draft, "compiled_calls": 0}
    assert not rows.compiled_steps_ran({"verify": verify, "draft_step": planned_only}, drafting_rounds=3)
    assert rows.compiled_steps_ran({"verify": verify, "draft_step": planned_only}, drafting_rounds=0)
    eager_draft = {"compiled": False, "compiled_calls": 0, "failure": None}
    assert not rows.compiled_steps_ran({"verify": verify, "draft_step": eager_draft}, drafting_rounds=3)
    fell_back = {**draft, "failure": "NameError: ..."}
    assert not rows.compiled_steps_ran({"verify": verify, "draft_step": fell_back}, drafting_rounds=3)
    assert not rows.compiled_steps_ran({"verify": {**verify, "compiled_calls": 0}, "draft_step": draft}, 3)
