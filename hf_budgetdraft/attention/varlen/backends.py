"""Which packed kernel `budgetdraft_varlen` calls: what this process can run, and the choice `use_backend` pins
for the code inside it (a `ContextVar`: other threads and asyncio tasks keep theirs).

- `flash_attn`: `flash_attn_varlen_func` of the `flash-attn` package (FlashAttention-2, Dao, arXiv 2307.08691);
  CUDA, fp16/bf16.
- `torch_varlen`: PyTorch's own `torch.nn.attention.varlen.varlen_attn` (torch >= 2.10); CUDA, fp16/bf16.
- `sdpa_packed`: `sdpa_varlen`, the packed format re-expanded into one masked SDPA call; any device and dtype (the
  CPU fallback, and how the CPU tests run the whole GPU data path).
- `sdpa`: never pack (the attention function runs `budgetdraft_sdpa`).
- `auto` (default): flash-attn, else torch varlen, on CUDA fp16/bf16; `budgetdraft_sdpa` elsewhere.

Under `torch.compile` the choice is read once while tracing and kept in the graph (no guard), as
`attention.scoped.using_attention`'s override is.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
from collections.abc import Callable, Iterator
from contextvars import ContextVar

import torch

BACKENDS = ("auto", "flash_attn", "torch_varlen", "sdpa_packed", "sdpa")
PACKED_BACKENDS = ("flash_attn", "torch_varlen", "sdpa_packed")  # the ones a forced choice packs with
_VARLEN_DTYPES = (torch.float16, torch.bfloat16)
_PINNED: ContextVar[str] = ContextVar("budgetdraft_varlen_backend", default="auto")


@functools.cache
def flash_attn_available() -> bool:
    """Whether the `flash-attn` package is importable (it is never imported on CPU-only code paths)."""
    return importlib.util.find_spec("flash_attn") is not None


def torch_varlen_attn() -> Callable | None:
    """`torch.nn.attention.varlen.varlen_attn`, or `None` on a torch without it (< 2.10)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@functools.cache
def torch_varlen_parameters() -> frozenset[str]:
    """The parameter names of the installed `varlen_attn` (they changed in every torch release since 2.10)."""
    return frozenset(inspect.signature(torch_varlen_attn()).parameters)


def available_backends() -> dict[str, bool]:
    """Which packed kernels this process can call: `flash_attn` and `torch_varlen` need CUDA; `sdpa_packed` always."""
    cuda = torch.cuda.is_available()
    return {
        "flash_attn": cuda and flash_attn_available(),
        "torch_varlen": cuda and torch_varlen_attn() is not None,
        "sdpa_packed": True,
    }


def _check_backend(name: str) -> None:
    if name not in BACKENDS:
        raise ValueError(f"varlen backend must be one of {BACKENDS}, got {name!r}")


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Pin the kernel `budgetdraft_varlen` uses inside the block.

    `"auto"` (default): flash-attn, else torch varlen on CUDA fp16/bf16; `budgetdraft_sdpa` elsewhere. `"flash_attn"` /
    `"torch_varlen"`: that kernel (an error where it cannot run). `"sdpa_packed"`: the packed data path with the SDPA
    kernel, on any device (what the CPU tests use). `"sdpa"`: never pack.
    """
    _check_backend(name)
    token = _PINNED.set(name)
    try:
        yield
    finally:
        _PINNED.reset(token)


@torch._dynamo.assume_constant_result
def _traced_backend() -> str:
    return _PINNED.get()


def current_backend() -> str:
    """The backend `use_backend` pinned in this context (`"auto"` outside any block)."""
    return _traced_backend() if torch.compiler.is_compiling() else _PINNED.get()


def resolve_backend(name: str, query: torch.Tensor) -> str:
    """The packed kernel `name` stands for, for `query`'s device and dtype (`"auto"` -> best available).

    Raises `ValueError` for `"flash_attn"` / `"torch_varlen"` where that kernel cannot run (not CUDA fp16/bf16, or
    the package / torch version missing).
    """
    _check_backend(name)
    on_cuda_half = query.is_cuda and query.dtype in _VARLEN_DTYPES
    if name == "auto":
        if on_cuda_half and flash_attn_available():
            return "flash_attn"
        if on_cuda_half and torch_varlen_attn() is not None:
            return "torch_varlen"
        return "sdpa_packed"
    if name in ("flash_attn", "torch_varlen"):
        available = flash_attn_available() if name == "flash_attn" else torch_varlen_attn() is not None
        if not (on_cuda_half and available):
            raise ValueError(
                f"varlen backend {name!r} needs CUDA tensors in fp16/bf16"
                + (
                    ""
                    if available
                    else f" and {'the flash-attn package' if name == 'flash_attn' else 'torch>=2.10'}"
                )
                + f", got a {query.dtype} tensor on {query.device}; use backend 'auto' or 'sdpa_packed'"
            )
    return name
