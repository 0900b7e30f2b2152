"""Hand the prefill queries of each attention layer to a cache layer that asked for them.

A `Cache` layer sees only keys and values. Query-scored policies (SnapKV, chunk with a query proxy) need the
last prefill queries too; transformers calls `cache.update(...)` and then, in the same attention forward, the
attention function. We register attention functions that wrap `sdpa`/`eager` and deliver the queries (RoPE
applied, times the layer's scaling) to the cache layer that requested them in that `update`. This works for
every model family that uses transformers' `AttentionInterface`, without re-deriving queries per family.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Protocol

import torch
from transformers import AttentionInterface, AttentionMaskInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import eager_mask, sdpa_mask

from .fast_sdpa import budgetdraft_sdpa_attention_forward, budgetdraft_sdpa_mask
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


class QueryReceiver(Protocol):
    def receive_queries(self, queries: torch.Tensor) -> None: ...


_request: ContextVar[tuple[QueryReceiver, int] | None] = ContextVar("budgetdraft_query_request", default=None)


def request_queries(receiver: QueryReceiver, layer_idx: int) -> None:
    """Called from `Cache.update`: the next attention call of layer `layer_idx` delivers its queries."""
    _request.set((receiver, layer_idx))


def cancel_request(receiver: QueryReceiver) -> bool:
    """Drop a request of `receiver` that no capturing attention function served; True if there was one."""
    pending = _request.get()
    if pending is not None and pending[0] is receiver:
        _request.set(None)
        return True
    return False


def _eager_for(module: torch.nn.Module) -> Callable:
    # Each modeling file defines its own eager attention (softcapping, sinks, ...): use the module's own.
    family_eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if family_eager is None:
        raise ValueError(
            f"{type(module).__name__} has no eager_attention_forward; use the sdpa capture instead"
        )
    return family_eager


def _make_capturing(base: str) -> Callable:
    def attention(module, query, key, value, attention_mask, **kwargs):
        pending = _request.get()
        if pending is not None and pending[1] == getattr(module, "layer_idx", None):
            _request.set(None)
            scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
            pending[0].receive_queries(query * scaling)  # (B, H_q, q_len, D)
        function = _SDPA_FUNCTIONS[base] if base in _SDPA_FUNCTIONS else _eager_for(module)
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


@contextlib.contextmanager
def query_capture(model: PreTrainedModel) -> Iterator[PreTrainedModel]:
    """Run `model` with query capture on; restores its attention implementation on exit.

    Example:
        >>> cache = BudgetedCache(config=model.config, budget=512, policy="snapkv")
        >>> with query_capture(model):
        ...     model(input_ids, cache=cache)
    """
    register()
    original = model.config._attn_implementation
    if original.startswith(CAPTURE_PREFIX):
        yield model
        return
    if original not in _BASES:
        raise ValueError(
            f"query capture wraps attn_implementation {sorted(_BASES)}, got {original!r}; load the drafter with "
            "attn_implementation='sdpa' to use a query-scored policy (snapkv, chunk with query_proxy='last_query')"
        )
    model.set_attn_implementation(CAPTURE_PREFIX + original)
    try:
        yield model
    finally:
        model.set_attn_implementation(original)
