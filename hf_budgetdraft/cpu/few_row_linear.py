"""Few-row linear layers on CPU: a decode step's matmuls on every thread.

A decoding target multiplies one row (an AR step) or a handful (a verification, a small batch) by each weight
matrix. For `x (rows, in) @ weight (out, in)^T` torch's CPU BLAS takes a one-thread matrix-vector path for one row
and a GEMM that repacks the weight for a few, so a target whose weights do not fit the CPU caches streams them at a
fraction of the memory bandwidth. `weight @ x^T` (the weight as the left operand, the rows as a narrow right one)
streams each weight once on all threads; one row is doubled to take that path. Same products, summed in another
order: outputs agree with `F.linear` to float rounding.

`few_row_linears(model)` runs `model`'s plain `nn.Linear` layers this way inside the block, for the code inside it
only: `nn.Linear.forward` is wrapped once (on first use) to look its layer up in a `ContextVar` the block sets, so
other threads and asyncio tasks using the same model keep `F.linear`, and no layer is ever written to. Inputs of more
than `MAX_ROWS` rows (a prefill), anything autograd records and anything `torch.compile` traces still run `F.linear`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import nn

MAX_ROWS = 64  # the measured range where weight @ x^T beat F.linear for a target's layers on this CPU path
# ids of the layers that run few_row_linear in this context (a new frozenset per block, never mutated)
_LAYERS: ContextVar[frozenset[int]] = ContextVar("budgetdraft_few_row_layers", default=frozenset())
_loaded_forward = nn.Linear.forward
_install_lock = threading.Lock()


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
    """Whether `few_row_linears` would change any layer of `model` (plain float32 `nn.Linear` layers on CPU, their
    weights plain tensors)."""
    return any(_eligible(m) for m in model.modules())


def _eligible(module: nn.Module) -> bool:
    return (
        type(module) is nn.Linear
        and type(module.weight) in (nn.Parameter, torch.Tensor)  # not a quantised tensor subclass (torchao)
        and module.weight.device.type == "cpu"
        and module.weight.dtype == torch.float32
        and "forward" not in module.__dict__  # a forward the user set on the instance is left alone
    )


def _scoped_forward(self: nn.Linear, input: torch.Tensor) -> torch.Tensor:
    if not torch.compiler.is_compiling() and runs_few_row(self):
        return few_row_linear(self, input)
    return _loaded_forward(self, input)


def runs_few_row(layer: nn.Module) -> bool:
    """Whether `layer` runs `few_row_linear` here (inside a `few_row_linears` block of this thread / task)."""
    return id(layer) in _LAYERS.get()


def _install() -> None:
    with _install_lock:
        if nn.Linear.forward is not _scoped_forward:
            nn.Linear.forward = _scoped_forward


def uninstall() -> None:
    """Put torch's own `nn.Linear.forward` back (the next `few_row_linears` block wraps it again)."""
    with _install_lock:
        if nn.Linear.forward is _scoped_forward:
            nn.Linear.forward = _loaded_forward


@contextlib.contextmanager
def few_row_linears(model: nn.Module, enabled: bool = True) -> Iterator[None]:
    """Run `model`'s plain float32 CPU `nn.Linear` layers through `few_row_linear` inside the block, in this thread /
    task only (`enabled=False`: untouched)."""
    layers = frozenset(id(m) for m in model.modules() if _eligible(m)) if enabled else frozenset()
    if not layers:
        yield
        return
    _install()
    token = _LAYERS.set(_LAYERS.get() | layers)
    try:
        yield
    finally:
        _LAYERS.reset(token)
