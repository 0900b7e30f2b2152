"""The packed varlen attention call, and its padded-in, padded-out form for sparse draft views.

`varlen_attention` runs one packed call (see `packing` for the format) through the kernel `backends` picks:
`flash_attn_varlen_func`, torch's `varlen_attn`, or `sdpa_varlen` — a plain SDPA re-expansion with the same
semantics that runs anywhere (the CPU fallback, and the oracle the GPU kernels are checked against). Causal
attention is aligned bottom-right (the queries are the last `q` keys of their segment), as flash-attn >= 2.1 and
`torch.nn.attention.varlen.varlen_attn` align it. `sparse_varlen_attention` is the padded-in, padded-out wrapper:
`pack_keys` / `pack_queries` -> kernel -> `unpack_output`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .backends import resolve_backend, torch_varlen_attn, torch_varlen_parameters
from .packing import check_key_valid, pack_keys, pack_queries, unpack_output


def sdpa_varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool,
    scale: float | None = None,
) -> torch.Tensor:
    """Varlen attention with SDPA: the packed segments re-expanded to `(N, max_seqlen)`, one masked SDPA call.

    Same contract as `flash_attn_varlen_func`: query `(T_q, H_q, D)`, key/value `(T_k, H_kv, D)`; causal attention
    aligned bottom-right (query `i` of a segment with `n_q` queries and `n_k` keys reads keys `j <= i + n_k - n_q`);
    a query with no key to read returns zeros. Differentiable. Returns `(T_q, H_q, D_v)`.
    """
    device = query.device
    segments = cu_seqlens_q.numel() - 1
    len_q, len_k = cu_seqlens_q.diff().long(), cu_seqlens_k.diff().long()  # (N,)
    total_q, total_k = query.shape[0], key.shape[0]
    arange = torch.arange(segments, device=device)
    seg_q = torch.repeat_interleave(arange, len_q, output_size=total_q)  # (T_q,) segment of each packed query
    seg_k = torch.repeat_interleave(arange, len_k, output_size=total_k)
    pos_q = (
        torch.arange(total_q, device=device) - cu_seqlens_q.long()[seg_q]
    )  # (T_q,) index inside the segment
    pos_k = torch.arange(total_k, device=device) - cu_seqlens_k.long()[seg_k]

    def padded(packed: torch.Tensor, seg: torch.Tensor, pos: torch.Tensor, length: int) -> torch.Tensor:
        out = packed.new_zeros(segments, length, *packed.shape[1:])  # (N, max_len, H, D)
        return out.index_put((seg, pos), packed).transpose(1, 2)  # (N, H, max_len, D)

    width_q, width_k = max(max_seqlen_q, 1), max(max_seqlen_k, 1)  # (a column even when every set is empty)
    q_pad = padded(query, seg_q, pos_q, width_q)
    k_pad, v_pad = padded(key, seg_k, pos_k, width_k), padded(value, seg_k, pos_k, width_k)
    rows = torch.arange(width_q, device=device)[None, :, None]  # (1, max_q, 1)
    cols = torch.arange(width_k, device=device)[None, None, :]  # (1, 1, max_k)
    visible = (rows < len_q[:, None, None]) & (cols < len_k[:, None, None])  # (N, max_q, max_k)
    if causal:
        visible &= cols <= rows + (len_k - len_q)[:, None, None]
    readable = visible.any(dim=-1)  # (N, max_q): rows with at least one key
    # an empty row would give NaN (and NaN gradients): let it read key 0, then zero its output
    visible[..., 0] |= ~readable
    out = F.scaled_dot_product_attention(
        q_pad,
        k_pad,
        v_pad,
        attn_mask=visible[:, None],
        scale=scale,
        enable_gqa=query.shape[1] != key.shape[1],
    )  # (N, H_q, max_q, D_v)
    out = out.transpose(1, 2)[seg_q, pos_q]  # (T_q, H_q, D_v)
    return torch.where(
        readable[seg_q, pos_q][:, None, None], out, torch.zeros((), dtype=out.dtype, device=device)
    )


def varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool,
    scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Packed varlen attention through the best kernel available (see `resolve_backend`).

    Args:
        query (`torch.Tensor` of shape `(T_q, H_q, D)`), key, value (`(T_k, H_kv, D)`): packed segments.
        cu_seqlens_q, cu_seqlens_k (`torch.IntTensor` of shape `(N + 1,)`): segment boundaries (int32).
        max_seqlen_q, max_seqlen_k (`int`): longest segments.
        causal (`bool`): bottom-right aligned causal mask inside each segment.
        scale (`float`, *optional*): softmax scale, `D ** -0.5` by default.
        backend (`str`): one of `BACKENDS` minus `"sdpa"`.

    Returns:
        `torch.Tensor` of shape `(T_q, H_q, D_v)`.
    """
    if query.shape[1] % key.shape[1]:
        raise ValueError(
            f"varlen attention needs the query heads to be a multiple of the key/value heads, got {query.shape[1]} "
            f"and {key.shape[1]}"
        )
    name = resolve_backend("sdpa_packed" if backend == "sdpa" else backend, query)
    if name == "flash_attn":
        from flash_attn import flash_attn_varlen_func

        return flash_attn_varlen_func(
            query,
            key,
            value,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            softmax_scale=scale,
            causal=causal,
        )
    if name == "torch_varlen":
        return torch_varlen_call(
            query,
            key,
            value,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            causal=causal,
            scale=scale,
        )
    return sdpa_varlen(
        query,
        key,
        value,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        causal=causal,
        scale=scale,
    )


def sparse_varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_valid: torch.Tensor | None = None,
    *,
    causal: bool = True,
    scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Attention of `q` new queries over per-(row, KV-head) key sets given as a padded buffer + a validity mask.

    Computes what masked SDPA computes with `attn_mask = key_valid` (and, if `causal`, the new block's own causal
    mask), by packing only the valid keys: `pack_keys` -> `varlen_attention` -> `unpack_output`.

    Args:
        query (`torch.Tensor` of shape `(B, H_q, q, D)`).
        key (`torch.Tensor` of shape `(B, H_kv, K, D)`), value (`(B, H_kv, K, D_v)`): padded key sets.
        key_valid (`torch.BoolTensor` of shape `(1 or B, 1 or H_kv, K)`, *optional*): the keys each segment reads.
            With `causal` and `q > 1` the last `q` slots must be the new block (all valid).
        causal (`bool`): the queries are the last `q` keys of their segment (bottom-right causal).
        scale (`float`, *optional*): softmax scale.
        backend (`str`): see `use_backend`.

    Returns:
        `torch.Tensor` of shape `(B, q, H_q, D_v)` (transformers' attention output layout).
    """
    batch, _, q_length = query.shape[:3]
    if (
        causal
        and q_length > 1
        and key_valid is not None
        and not bool(check_key_valid(key_valid, key)[..., -q_length:].all())
    ):
        raise ValueError(
            f"causal varlen attention of a {q_length}-token block needs its own keys in the last {q_length} slots "
            "of every key set, but key_valid hides some of them; pass causal=False or mark them valid"
        )
    packed = pack_keys(key, value, key_valid)
    queries, cu_seqlens_q, max_seqlen_q = pack_queries(query, packed.num_segment_heads)
    out = varlen_attention(
        queries,
        packed.keys,
        packed.values,
        cu_seqlens_q,
        packed.cu_seqlens,
        max_seqlen_q,
        packed.max_seqlen,
        causal=causal,
        scale=scale,
        backend=backend,
    )
    return unpack_output(out, batch, q_length, packed.num_segment_heads)


def torch_varlen_call(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    scale: float | None,
) -> torch.Tensor:
    """`varlen_attn` bound to the installed torch's signature: 2.10 takes `is_causal` and no `scale` (the query is
    scaled instead), 2.11 `window_size` and `scale`, 2.13 also `enable_gqa`; where that flag is missing, key/value
    heads are repeated to the query's (exact).

    Shapes as in `varlen_attention`.
    """
    parameters = torch_varlen_parameters()
    grouped = query.shape[1] != key.shape[1]
    kwargs: dict = {}
    if "scale" in parameters:
        kwargs["scale"] = scale
    elif scale is not None:  # the kernel scales by head_dim ** -0.5
        query = query * (scale * query.shape[-1] ** 0.5)
    if "window_size" in parameters:
        kwargs["window_size"] = (-1, 0) if causal else (-1, -1)
    else:
        kwargs["is_causal"] = causal
    if "enable_gqa" in parameters:
        kwargs["enable_gqa"] = grouped
    elif grouped:
        repeats = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(repeats, dim=1), value.repeat_interleave(repeats, dim=1)
    return torch_varlen_attn()(
        query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kwargs
    )
