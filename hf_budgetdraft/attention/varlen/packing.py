"""Padded key sets <-> the packed varlen format (FlashAttention-2's, Dao, arXiv 2307.08691).

A *segment* is one (row, KV-head group): `N = B * H_s` segments, `H_s` = 1 (all KV heads of a row share one key set)
or `H_kv` (one key set per KV head). Packed keys are `(T_k, H_kv / H_s, D)`, segment after segment, with
`cu_seqlens_k = [0, n_0, n_0 + n_1, ...]` (int32, `(N + 1,)`); packed queries are `(N * q, H_q / H_s, D)` with
`cu_seqlens_q = [0, q, 2q, ...]`. GQA stays native: query head `i` of a segment reads KV head `i // (H_q / H_kv)`,
so KV heads are never repeated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PackedKeys:
    """Key/value sets packed back to back (the `_k` half of a varlen call).

    Attributes:
        keys (`torch.Tensor` of shape `(T_k, H_kv / H_s, D)`): the kept keys, segment after segment.
        values (`torch.Tensor` of shape `(T_k, H_kv / H_s, D_v)`).
        cu_seqlens (`torch.IntTensor` of shape `(N + 1,)`): segment `i` is rows `[cu_seqlens[i], cu_seqlens[i+1])`.
        max_seqlen (`int`): the longest segment.
        index (`torch.LongTensor` of shape `(T_k,)`, *optional*): row of each packed key in the segment-major padded
            layout `(N * K)` (`segment * K + slot`); `None` when every key is kept.
        num_segment_heads (`int`): H_s, key sets per row (1 or H_kv).
    """

    keys: torch.Tensor
    values: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    index: torch.Tensor | None
    num_segment_heads: int


def check_key_valid(key_valid: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """`key_valid` broadcast to `(B, H_s, K)`; raises unless it fits `key` `(B, H_kv, K, D)`."""
    batch, num_kv_heads, kv_length = key.shape[:3]
    if key_valid.dtype != torch.bool or key_valid.dim() != 3:
        raise ValueError(
            f"key_valid must be a bool tensor (B, 1 or H_kv, K), got {key_valid.dtype} of shape "
            f"{tuple(key_valid.shape)}; True marks a key the segment's queries read"
        )
    rows, heads, length = key_valid.shape
    if rows not in (1, batch) or heads not in (1, num_kv_heads) or length != kv_length:
        raise ValueError(
            f"key_valid of shape {tuple(key_valid.shape)} does not fit keys (B={batch}, H_kv={num_kv_heads}, "
            f"K={kv_length}); expected (1 or {batch}, 1 or {num_kv_heads}, {kv_length})"
        )
    return key_valid.expand(batch, heads, kv_length)


def _segments(tensor: torch.Tensor, num_segment_heads: int) -> torch.Tensor:
    """`(B, H, L, D)` -> `(B * H_s * L, H / H_s, D)`: segment-major rows, the segment's heads in the middle axis."""
    batch, heads, length, dim = tensor.shape
    grouped = tensor.reshape(batch, num_segment_heads, heads // num_segment_heads, length, dim)
    return grouped.permute(0, 1, 3, 2, 4).reshape(
        batch * num_segment_heads * length, heads // num_segment_heads, dim
    )


def pack_keys(key: torch.Tensor, value: torch.Tensor, key_valid: torch.Tensor | None = None) -> PackedKeys:
    """Pack the kept keys/values of every (row, KV-head group) segment back to back.

    Args:
        key (`torch.Tensor` of shape `(B, H_kv, K, D)`): padded keys (e.g. a cache layer's buffer).
        value (`torch.Tensor` of shape `(B, H_kv, K, D_v)`).
        key_valid (`torch.BoolTensor` of shape `(1 or B, 1 or H_kv, K)`, *optional*): which keys each segment
            keeps, in slot order; `None` keeps all (uniform segments of `K`, no host sync).
    """
    batch, num_kv_heads, kv_length = key.shape[:3]
    if key_valid is None:
        rows = torch.arange(batch + 1, device=key.device, dtype=torch.int32) * kv_length
        return PackedKeys(_segments(key, 1), _segments(value, 1), rows, kv_length, None, 1)
    valid = check_key_valid(key_valid, key)  # (B, H_s, K)
    num_segment_heads = valid.shape[1]
    index = valid.reshape(-1).nonzero().squeeze(1)  # (T_k,) into the (N * K) segment-major layout
    seqlens = valid.sum(dim=-1, dtype=torch.int32).reshape(-1)  # (N,)
    cu_seqlens = F.pad(seqlens.cumsum(0, dtype=torch.int32), (1, 0))  # (N + 1,)
    max_seqlen = int(seqlens.max()) if seqlens.numel() else 0
    keys = _segments(key, num_segment_heads).index_select(0, index)  # (T_k, H_kv / H_s, D)
    values = _segments(value, num_segment_heads).index_select(0, index)
    return PackedKeys(keys, values, cu_seqlens, max_seqlen, index, num_segment_heads)


def pack_queries(query: torch.Tensor, num_segment_heads: int = 1) -> tuple[torch.Tensor, torch.Tensor, int]:
    """`(B, H_q, q, D)` -> `(queries (B * H_s * q, H_q / H_s, D), cu_seqlens_q (N + 1,), max_seqlen_q = q)`."""
    batch, num_heads, q_length = query.shape[:3]
    if num_heads % num_segment_heads:
        raise ValueError(
            f"{num_heads} query heads cannot be split into {num_segment_heads} key sets per row; H_q must be a "
            "multiple of H_kv"
        )
    segments = batch * num_segment_heads
    cu_seqlens = torch.arange(segments + 1, device=query.device, dtype=torch.int32) * q_length
    return _segments(query, num_segment_heads), cu_seqlens, q_length


def unpack_output(
    output: torch.Tensor, batch: int, q_length: int, num_segment_heads: int = 1
) -> torch.Tensor:
    """Packed output `(B * H_s * q, H_q / H_s, D_v)` -> transformers' attention output layout `(B, q, H_q, D_v)`."""
    group_heads, dim = output.shape[1:]
    out = output.reshape(batch, num_segment_heads, q_length, group_heads, dim)  # (B, H_s, q, H_q / H_s, D_v)
    return out.permute(0, 2, 1, 3, 4).reshape(batch, q_length, num_segment_heads * group_heads, dim)
