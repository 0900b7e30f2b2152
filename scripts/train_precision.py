"""The training scripts' precision: bfloat16 autocast where the hardware runs it fast, float32 where it does not.

bf16 autocast halves a GPU step's memory traffic, and on a CPU with bf16 units (AMX, AVX512-BF16) it speeds a step
up several times. On a CPU with AVX2 only, torch runs a bf16 linear layer through a slow fallback, several times
slower than float32 (docs/training.md). So `--precision auto` (the default of `train_target.py`,
`train_far_target.py` and `train_drafts.py`) picks per device: bf16 on CUDA; on CPU, bf16 only where a bf16 linear
layer of a training step's size runs faster than a float32 one, timed once per process. `bf16` and `fp32` force
a choice; the scripts log the one that ran.
"""

from __future__ import annotations

import argparse
import functools
import time

import torch

CHOICES = ("auto", "bf16", "fp32")


def add_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--precision",
        choices=CHOICES,
        default="auto",
        help="bf16 autocast or float32: auto = bf16 on CUDA, and on CPU where bf16 runs faster than float32",
    )


def _best_seconds(dtype: torch.dtype, repeats: int = 3) -> float:
    """The fastest of `repeats` linear layers of `(256, 512) x (512, 512)` in `dtype` (after one warm-up)."""
    inputs, weight = torch.randn(256, 512, dtype=dtype), torch.randn(512, 512, dtype=dtype)
    torch.nn.functional.linear(inputs, weight)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.nn.functional.linear(inputs, weight)
        best = min(best, time.perf_counter() - start)
    return best


@functools.cache
def cpu_bf16_is_faster() -> bool:
    """Whether this CPU runs a bf16 linear layer faster than a float32 one (bf16 units), timed once."""
    return _best_seconds(torch.bfloat16) < _best_seconds(torch.float32)


def autocast_dtype(device: torch.device, precision: str) -> torch.dtype | None:
    """The autocast dtype of a training step on `device` under `--precision` (`None`: float32, no autocast)."""
    if precision not in CHOICES:
        raise ValueError(f"precision must be one of {CHOICES}, got {precision!r}")
    if precision != "auto":
        return torch.bfloat16 if precision == "bf16" else None
    if device.type == "cuda" or (device.type == "cpu" and cpu_bf16_is_faster()):
        return torch.bfloat16
    return None


def autocast(device: torch.device, dtype: torch.dtype | None):
    """`torch.autocast` to `dtype` on `device`'s type, or a disabled one for float32 (`dtype is None`)."""
    return torch.autocast(device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None)


def describe(dtype: torch.dtype | None) -> str:
    return "bf16 autocast" if dtype is not None else "float32"
