"""Few-row linear layers on CPU: a decode step's matmuls on every thread.

A decoding target multiplies one row (an AR step) or a handful (a verification, a small batch) by each weight
matrix. For `x (rows, in) @ weight (out, in)^T` torch's CPU BLAS takes a one-thread matrix-vector path for one row
and a GEMM that repacks the weight for a few, so a target whose weights do not fit the CPU caches streams them at a
fraction of the memory bandwidth. `weight @ x^T` (the weight as the left operand, the rows as a narrow right one)
streams each weight once on all threads; one row is doubled to take that path. Same products, summed in another
order: outputs agree with `F.linear` to float rounding.

`few_row_linears(model)` swaps the `forward` of `model`'s plain `nn.Linear` layers for the block (restored on
exit); inputs of more than `MAX_ROWS` rows (a prefill) and anything autograd records still run `F.linear`.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

MAX_ROWS = 64  # the measured range where weight @ x^T beat F.linear for a target's layers on this CPU path


def few_row_linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`layer(x)` for `x (..., in)`: `weight @ x^T` for at most `MAX_ROWS` rows, else `F.linear`. `(..., out)`."""
    rows = x.numel() // layer.in_features
    records_grad = torch.is_grad_enabled() and (x.requires_grad or layer.weight.requires_grad)
    if rows > MAX_ROWS or rows == 0 or records_grad:
        return F.linear(x, layer.weight, layer.bias)
    flat = x.reshape(rows, layer.in_features)
    if rows == 1:
        flat = torch.cat([flat, flat])  # two columns: the threaded GEMM path, not the one-thread GEMV
    if layer.bias is None:
        out = torch.mm(layer.weight, flat.t())  # (out, rows)
    else:
        out = torch.addmm(layer.bias[:, None], layer.weight, flat.t())
    return out[:, :rows].t().contiguous().reshape(*x.shape[:-1], layer.out_features)


def few_row_linear_applies(model: nn.Module) -> bool:
    """Whether `few_row_linears` would change any layer of `model` (plain float32 `nn.Linear` layers on CPU)."""
    return any(_eligible(m) for m in model.modules())


def _eligible(module: nn.Module) -> bool:
    return (
        type(module) is nn.Linear
        and module.weight.device.type == "cpu"
        and module.weight.dtype == torch.float32
        and "forward" not in module.__dict__  # a forward set on the instance (ours, the user's) is left alone
    )


def few_row_linears(model: nn.Module, enabled: bool = True) -> contextlib.AbstractContextManager:
    """Run `model`'s plain float32 CPU `nn.Linear` layers through `few_row_linear` inside the block (`enabled=False`:
    untouched); their own `forward` is back on exit."""
    return swapped_forward([m for m in model.modules() if _eligible(m)] if enabled else [], few_row_linear)


@contextlib.contextmanager
def swapped_forward(layers: list[nn.Module], forward: Callable) -> Iterator[None]:
    """Each of `layers` runs `forward(layer, *args)` inside the block (set on the instance, which `_eligible` then
    leaves alone); the class's own `forward` is back on exit."""
    for layer in layers:
        layer.forward = types.MethodType(forward, layer)
    try:
        yield
    finally:
        for layer in layers:
            layer.__dict__.pop("forward", None)
