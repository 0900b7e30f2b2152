"""`scripts/gpu_check.py --cpu-smoke`: the GPU check's logic at tiny sizes on CPU.

The GPU run itself cannot happen here; this proves the script runs end to end, writes the JSON the GPU run will
write, and that its checks can fail (a failing section is recorded and turns the exit code to 1)."""

import importlib.util
import json

import pytest
import torch
from repo_paths import SCRIPTS
from torch_support import needs_traceable_transformers

SCRIPT = SCRIPTS / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def fresh_dynamo():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    torch.set_num_threads(threads)


@needs_traceable_transformers
def test_cpu_smoke_runs_every_section_and_passes(gpu_check, tmp_path, fresh_dynamo):
    code = gpu_check.main(["--out", str(tmp_path), "--cpu-smoke"])
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    failed = {name: check for name, check in report["checks"].items() if not check["passed"]}
    assert code == 0 and report["all_passed"] and not failed and not report["errors"], (
        failed,
        report["errors"],
    )
    assert report["mode"] == "cpu-smoke" and report["environment"]["varlen_backends"]["sdpa_packed"]

    # 1. kernels: the packed SDPA kernel in fp32 and bf16, both key-set layouts, forward and backward
    kernels = report["kernels"]
    assert {(k["dtype"], k["key_sets"], k["q_length"]) for k in kernels} == {
        (d, s, q) for d in ("float32", "bfloat16") for s in ("per_row", "per_kv_head") for q in (1, 4)
    }
    assert all(k["max_abs_error"] < 1e-5 for k in kernels if k["dtype"] == "float32")
    assert {s["what"] for s in report["skipped"]} >= {"kernels.flash_attn", "kernels.torch_varlen"}

    # 2. + 3. greedy equivalence on every draft path, fp32 and bf16, with the envelope rows
    labels = {
        "ar",
        "native",
        "oneliner",
        "sink_window",
        "sink_window_static",
        "budgeted_static",
        "budgeted_snapkv",
    }
    for dtype in ("float32", "bfloat16"):
        runs = report["greedy"]["runs"][dtype]
        assert set(runs) == labels
        assert all(row["diff_vs_ar"] == 0 for row in runs.values())  # CPU: exact in both dtypes here
        assert runs["sink_window_static"]["rounds"] > 0 and runs["oneliner"]["rounds"] > 0
        assert report["greedy"]["compiled_graphs_per_repeat"][dtype][1:] == [0]  # no recompiles
    kinds = {row["kind"] for row in report["greedy"]["envelope"]["bfloat16"]}
    assert kinds == {"native_vs_ar", "windowed_vs_native", "windowed_vs_ar"}

    # 5. cost curves: every draft step timed at every context, the verification curve, the one-liner, the table
    costs = report["cost_curves"]
    assert [c["context"] for c in costs["contexts"]] == [96, 160]
    for record in costs["contexts"]:
        assert set(record["draft_step_s"]) == {
            f"{cache}_{kind}"
            for cache, kinds in {
                "full": ("eager", "compiled"),
                "sink_window": ("eager", "static_eager", "static_compiled"),
                "budgeted": ("eager", "static_eager", "static_compiled"),
            }.items()
            for kind in kinds
        }
        assert (
            len(record["verify_s"]) == 5 and all(t > 0 for t in record["verify_s"]) and not record["errors"]
        )
        assert set(record["compile_s"]) == {
            "full_compiled",
            "sink_window_static_compiled",
            "budgeted_static_compiled",
        }
    oneliner = costs["oneliner"]
    assert set(oneliner["decode_s_per_token"]) == {"ar_stock", "oneliner_fixed", "oneliner_default"}
    assert oneliner["plans"]["oneliner_fixed"]["draft_length"] == 2 and oneliner["default_over_plain"] > 0
    sources = {row["acceptance"].split(" (")[0] for row in costs["speedup"]}
    assert sources == {"bundled greedy", "bundled T0.8", "paper alpha=0.79"}
    assert all(row["speedup_vs_fast_ar"] >= 1.0 for row in costs["speedup"])  # gamma = 0 is plain AR
    import gpu_speedup  # the tables of docs/gpu.md, from the same JSON

    tables = gpu_speedup.markdown(report)
    assert "| 96 |" in tables and "Expected decode speed-up over plain `generate()`" in tables

    # 4. one training step: varlen views == sdpa views, and the step moved the loss
    views = report["training_step"]["views"]
    assert set(views) == {"budgeted_chunk", "sink_window"}
    assert all(v["relative_grad_difference"] < 1e-4 for v in views.values())
    step = report["training_step"]["optimizer_step"]
    assert step["loss_after"] != step["loss_before"]


def test_a_failing_section_is_recorded_and_fails_the_run(gpu_check, tmp_path):
    report = gpu_check.Report(tmp_path / "gpu_check.json", "cpu-smoke", time_budget=60, margin_tolerance=0.25)

    def broken(report):
        raise RuntimeError("kernel exploded")

    def fine(report):
        report.check("fine.check", True)
        return {"value": 1}

    report.section("broken", broken)
    report.section("fine", fine)
    written = json.loads((tmp_path / "gpu_check.json").read_text())
    assert written["fine"] == {"value": 1} and not written["all_passed"]
    assert written["errors"][0]["section"] == "broken" and "kernel exploded" in written["errors"][0]["error"]
    assert written["checks"]["broken.ran"]["passed"] is False


def test_each_section_records_its_peak_gpu_memory_even_when_it_fails(gpu_check, tmp_path, monkeypatch):
    readings = iter([3, 6, 5, 10])  # GiB: allocated then reserved, a section at a time
    resets = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: resets.append(1))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: next(readings) * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda: next(readings) * 2**30)
    report = gpu_check.Report(tmp_path / "gpu_check.json", "gpu", time_budget=60, margin_tolerance=0.25)

    def out_of_memory(report):
        raise torch.OutOfMemoryError("CUDA out of memory")

    report.section("fine", lambda report: {})
    report.section("long", out_of_memory)
    written = json.loads((tmp_path / "gpu_check.json").read_text())
    assert len(resets) == 2
    assert written["section_peak_gib"] == {
        "fine": {"allocated": 3.0, "reserved": 6.0},
        "long": {"allocated": 5.0, "reserved": 10.0},
    }
    assert written["errors"][0]["section"] == "long"


def test_no_gpu_memory_is_recorded_on_cpu(gpu_check, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    report = gpu_check.Report(tmp_path / "gpu_check.json", "cpu-smoke", time_budget=60, margin_tolerance=0.25)
    report.section("fine", lambda report: {})
    assert "section_peak_gib" not in json.loads((tmp_path / "gpu_check.json").read_text())


def test_refuses_to_run_without_cuda_unless_smoke(gpu_check, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.main(["--out", str(tmp_path)])
    assert exit_info.value.code == 2
