"""The training scripts' precision: bf16 autocast where the hardware runs it fast, float32 elsewhere."""

import sys

import pytest
import torch
import train_precision

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # a device object needs no GPU


def test_a_forced_choice_is_kept_and_a_bad_one_is_named():
    for device in (CPU, CUDA):
        assert train_precision.autocast_dtype(device, "bf16") is torch.bfloat16
        assert train_precision.autocast_dtype(device, "fp32") is None
    with pytest.raises(ValueError, match="'fp16'"):
        train_precision.autocast_dtype(CPU, "fp16")


@pytest.mark.parametrize("bf16_faster", [True, False])
def test_auto_is_bf16_on_cuda_and_on_a_cpu_only_where_bf16_runs_faster(monkeypatch, bf16_faster):
    monkeypatch.setattr(train_precision, "cpu_bf16_is_faster", lambda: bf16_faster)
    assert train_precision.autocast_dtype(CUDA, "auto") is torch.bfloat16
    assert train_precision.autocast_dtype(CPU, "auto") is (torch.bfloat16 if bf16_faster else None)
    assert train_precision.autocast_dtype(torch.device("meta"), "auto") is None


def test_the_cpu_probe_times_both_dtypes_once_a_process(monkeypatch):
    timed = []

    def best_seconds(dtype, repeats=3):
        timed.append(dtype)
        return 1.0 if dtype is torch.bfloat16 else 2.0

    monkeypatch.setattr(train_precision, "_best_seconds", best_seconds)
    train_precision.cpu_bf16_is_faster.cache_clear()
    try:
        assert train_precision.cpu_bf16_is_faster() and train_precision.cpu_bf16_is_faster()
        assert sorted(map(str, timed)) == ["torch.bfloat16", "torch.float32"]
    finally:
        train_precision.cpu_bf16_is_faster.cache_clear()


def test_the_step_runs_in_the_chosen_precision():
    linear = torch.nn.Linear(8, 8)
    with train_precision.autocast(CPU, None):
        assert linear(torch.randn(2, 8)).dtype == torch.float32
    with train_precision.autocast(CPU, torch.bfloat16):
        assert linear(torch.randn(2, 8)).dtype == torch.bfloat16
    assert train_precision.describe(None) == "float32"


@pytest.mark.parametrize("script", ["train_drafts", "train_target"])
def test_the_training_scripts_take_precision(monkeypatch, script):
    module = __import__(script)
    required = ["--target", "t"] if script == "train_drafts" else []
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *required, "--precision", "fp32"])
    assert module.parse_args().precision == "fp32"
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *required, "--precision", "half"])
    with pytest.raises(SystemExit):
        module.parse_args()


def test_the_far_target_run_takes_precision():
    import train_far_target

    assert train_far_target.parse(["train", "--out", "o"]).precision == "auto"
    assert train_far_target.parse(["train", "--out", "o", "--precision", "bf16"]).precision == "bf16"
