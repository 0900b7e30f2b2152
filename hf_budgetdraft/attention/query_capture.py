"""Hand the prefill queries of each attention layer to a cache layer that asked for them.

A `Cache` layer sees only keys and values. Query-scored policies (SnapKV, chunk with a query proxy) need the
last prefill queries too; transformers calls `cache.update(...)` and then, in the same attention forward, the
attention function. Two ways to catch that call, without re-deriving queries per family:

- families that dispatch through transformers' `AttentionInterface` (the model can switch its attention
  implementation): registered attention functions wrap `sdpa`/`eager` and deliver the queries (RoPE applied,
  times the layer's scaling) to the cache layer that requested them in that `update`;
- families whose attention calls torch directly (Falcon: `F.scaled_dot_product_attention`, or `query @ key^T`):
  a `TorchFunctionMode`, active only inside `query_capture`, recognises the attention op by its key operand — the
  very tensor the requesting layer's `update` returned — and delivers its query operand, scaled by the op's
  `scale` (SDPA) or `1 / sqrt(D)`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import eager_mask, sdpa_mask

from .fast_sdpa import budgetdraft_sdpa_attention_forward, budgetdraft_sdpa_mask
from .function_parts import family_eager_attention
from .scoped import using_attention
from .varlen import budgetdraft_varlen_attention_forward, budgetdraft_varlen_mask

CAPTURE_PREFIX = "budgetdraft_capture_"
_BASES = {
    "sdpa": sdpa_mask,
    "eager": eager_mask,
    "budgetdraft_sdpa": budgetdraft_sdpa_mask,
    "budgetdraft_varlen": budgetdraft_varlen_mask,
}
_SDPA_FUNCTIONS = {
    "sdpa": sdpa_attention_forward,
    "budgetdraft_sdpa": budgetdraft_sdpa_attention_forward,
    "budgetdraft_varlen": budgetdraft_varlen_attention_forward,
}


_MATMULS = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__)
# a capture of "eager" runs the module's own modeling-file eager attention (softcapping, sinks, ...)
_NO_EAGER = "has no eager_attention_forward; use the sdpa capture instead"


class QueryReceiver(Protocol):
    def receive_queries(self, queries: torch.Tensor) -> None: ...


class _Request(NamedTuple):
    receiver: QueryReceiver
    layer_idx: int
    keys: torch.Tensor | None  # what the layer's `update` returned, `(B, H_kv, L, D)`


_request: ContextVar[_Request | None] = ContextVar("budgetdraft_query_request", default=None)


def request_queries(receiver: QueryReceiver, layer_idx: int, keys: torch.Tensor | None = None) -> None:
    """Called from `Cache.update`: the next attention call of layer `layer_idx` delivers its queries.

    `keys` (the keys this `update` returns) let the op-level capture recognise an attention computed with plain
    torch ops; without them only the `AttentionInterface` capture can serve the request.
    """
    _request.set(_Request(receiver, layer_idx, keys))


def cancel_request(receiver: QueryReceiver) -> bool:
    """Drop a request of `receiver` that no capturing attention function served; True if there was one."""
    pending = _request.get()
    if pending is not None and pending.receiver is receiver:
        _request.set(None)
        return True
    return False


def _deliver(pending: _Request, queries: torch.Tensor) -> None:
    _request.set(None)
    pending.receiver.receive_queries(queries)  # (B, H_q, q_len, D), times the attention scaling


def _make_capturing(base: str) -> Callable:
    def attention(module, query, key, value, attention_mask, **kwargs):
        pending = _request.get()
        # the layer's own call: by index, or by the keys its update returned (a model reusing one layer at several
        # cache indices, HRM-Text's cycles, calls update with an index of its own)
        if pending is not None and (
            pending.layer_idx == getattr(module, "layer_idx", None)
            or (pending.keys is not None and key is pending.keys)
        ):
            scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
            _deliver(pending, query * scaling)
        function = _SDPA_FUNCTIONS.get(base) or family_eager_attention(module, _NO_EAGER)
        return function(module, query, key, value, attention_mask, **kwargs)

    attention.__name__ = f"{CAPTURE_PREFIX}{base}"
    return attention


def register() -> None:
    """Register `budgetdraft_capture_{sdpa,eager,budgetdraft_sdpa,budgetdraft_varlen}` (idempotent)."""
    for base, mask in _BASES.items():
        name = CAPTURE_PREFIX + base
        if name not in AttentionInterface._global_mapping:
            AttentionInterface.register(name, _make_capturing(base))
            AttentionMaskInterface.register(name, mask)


def _is_transposed(tensor: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether `tensor` is `keys.transpose(-1, -2)` (the same storage, seen as `(B, H_kv, D, L)`)."""
    return (
        tensor.dim() == keys.dim() >= 2
        and tensor.data_ptr() == keys.data_ptr()
        and tensor.shape == keys.transpose(-1, -2).shape
        and tensor.stride() == keys.transpose(-1, -2).stride()
    )


def _attention_query(func, args: tuple, kwargs: dict, keys: torch.Tensor) -> torch.Tensor | None:
    """The scaled query `(B, H_q, q, D)` of a torch attention op on `keys`, or None if `func(*args)` is not one."""
    if func is F.scaled_dot_product_attention:
        query = args[0] if args else kwargs.get("query")
        key = args[1] if len(args) > 1 else kwargs.get("key")
        if key is keys:
            scale = kwargs.get("scale") or query.shape[-1] ** -0.5
            return query * scale
    elif func in _MATMULS and len(args) == 2 and torch.is_tensor(args[1]) and _is_transposed(args[1], keys):
        return args[0] * args[0].shape[-1] ** -0.5  # the op shows no scaling; attention's default
    return None


class _OpCapture(torch.overrides.TorchFunctionMode):
    """Serve a pending request from the torch attention op (SDPA or `query @ key^T`) that reads its keys."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        pending = _request.get()
        if pending is not None and pending.keys is not None:
            query = _attention_query(func, args, kwargs, pending.keys)
            if query is not None:
                _deliver(pending, query)
        return func(*args, **kwargs)


@contextlib.contextmanager
def query_capture(model: PreTrainedModel) -> Iterator[PreTrainedModel]:
    """Run `model` with query capture on inside the block, in this thread / task only (`using_attention`).

    A model that dispatches through transformers' `AttentionInterface` runs the capturing attention; one whose
    attention calls torch directly (`_can_set_attn_implementation()` is False, e.g. Falcon) keeps its attention
    and is watched at the op level instead.

    Example:
        >>> cache = BudgetedCache(config=model.config, budget=512, policy="snapkv")
        >>> with query_capture(model):
        ...     model(input_ids, cache=cache)
    """
    register()
    if not model._can_set_attn_implementation():
        with _OpCapture():
            yield model
        return
    current = model.config._attn_implementation
    if current.startswith(CAPTURE_PREFIX):
        yield model
        return
    if current not in _BASES:
        raise ValueError(
            f"query capture wraps attn_implementation {sorted(_BASES)}, got {current!r}; load the drafter with "
            "attn_implementation='sdpa' to use a query-scored policy (snapkv, chunk with query_proxy='last_query')"
        )
    with using_attention(model, CAPTURE_PREFIX + current):
        yield model
