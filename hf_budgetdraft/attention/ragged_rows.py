"""Attention for the rows of a ragged batch, each over its own keys: no mask, nothing past a row's length read.

A batched speculative forward feeds every row `q` tokens at its own positions `[L_b, L_b + q)`, and a row may need
only its first `n_b <= q` of them (a row that drafts fewer tokens, or none, this round). The masked path attends
every query to the longest row's keys through a `(B, 1, q, K)` mask. On CPU this attends row by row instead: row
b's first `n_b` queries over its keys `[0, L_b + n_b)`, a view of the cache buffer (no copy), through the same
unmasked kernels a single sequence uses (the past/block split of `budgetdraft_sdpa`); its other queries get zeros.
Their tokens are the caller's filler: nothing a kept query reads depends on them, and the caller crops them.

`ragged_rows(cache)` makes a ragged cache's spans visible to `budgetdraft_sdpa` for the forwards inside the block.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

import torch

_active: ContextVar[object | None] = ContextVar("budgetdraft_ragged_rows", default=None)


@contextlib.contextmanager
def ragged_rows(cache) -> Iterator[None]:
    """Inside the block, layers for which `cache.row_spans(layer_idx)` returns spans attend row by row."""
    token = _active.set(cache)
    try:
        yield
    finally:
        _active.reset(token)


def active_row_spans(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor) -> list | None:
    """`[(L_b, n_b)] * B` for this attention call when it can attend row by row (a CPU forward of the active ragged
    cache, at a layer whose keys are position-indexed full attention), else `None` (the masked path)."""
    if query.device.type != "cpu" or torch.compiler.is_compiling():
        return None  # (read first: a compiled graph never reaches the ContextVar, which dynamo cannot trace)
    cache = _active.get()
    layer_idx = getattr(module, "layer_idx", None)
    if cache is None or layer_idx is None:
        return None
    spans = cache.row_spans(layer_idx)
    if spans is None or len(spans) != query.shape[0] or key.shape[0] != query.shape[0]:
        return None
    return spans


def row_by_row_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None, spans: list, attend
) -> torch.Tensor:
    """Causal attention of each row's first `n_b` queries over its keys `[0, L_b + n_b)`.

    Args:
        query (`torch.Tensor` of shape `(B, H_q, q, D)`): query `i` of row b sits at position `L_b + i`.
        key, value (`torch.Tensor` of shape `(B, H_kv, K, D)`): position-indexed keys (slot p = position p).
        scaling (`float`, *optional*): softmax scale.
        spans (`list[tuple[int, int]]`): `(L_b, n_b)` per row, `n_b <= q`.
        attend (`Callable`): `(query, key, value, scaling) -> out`, unmasked causal attention of `n` queries that
            are the last `n` of the keys (`budgetdraft_sdpa`'s: one query, or the past/block split).

    Returns:
        `torch.Tensor` of shape `(B, H_q, q, D_v)`; queries past a row's `n_b` are zeros.
    """
    out = query.new_zeros(*query.shape[:-1], value.shape[-1])
    for row, (start, count) in enumerate(spans):
        if count == 0:
            continue
        end = start + count
        q, k, v = query[row : row + 1, :, :count], key[row : row + 1, :, :end], value[row : row + 1, :, :end]
        out[row : row + 1, :, :count] = attend(q, k, v, scaling)
    return out
