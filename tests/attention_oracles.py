"""Reference computations the attention tests (and `scripts/gpu_check.py`) check the kernels against."""

import torch
import torch.nn.functional as F

from hf_budgetdraft.attention.function_parts import out_layout
from hf_budgetdraft.attention.varlen import check_key_valid


def masked_sdpa_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_valid: torch.Tensor | None = None,
    *,
    causal: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """What `sparse_varlen_attention` computes, as plain masked SDPA on the padded keys.

    Query `(B, H_q, q, D)`, key/value `(B, H_kv, K, D)` / `(B, H_kv, K, D_v)`, `key_valid` `(1 or B, 1 or H_kv, K)`;
    with `causal` the queries are the last `q` keys (bottom-right). A query with no key to read returns zeros.
    Returns `(B, q, H_q, D_v)`.
    """
    batch, num_heads, q_length = query.shape[:3]
    num_kv_heads, kv_length = key.shape[1:3]
    mask = torch.ones(batch, num_kv_heads, q_length, kv_length, dtype=torch.bool, device=query.device)
    if key_valid is not None:
        mask = mask & check_key_valid(key_valid, key)[:, :, None, :]
    if causal:
        rows = torch.arange(q_length, device=query.device)[:, None] + (kv_length - q_length)
        mask = mask & (torch.arange(kv_length, device=query.device)[None, :] <= rows)
    mask = mask.repeat_interleave(num_heads // num_kv_heads, dim=1)  # (B, H_q, q, K)
    readable = mask.any(dim=-1, keepdim=True)
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask | ~readable, scale=scale, enable_gqa=num_heads != num_kv_heads
    )
    return out_layout(torch.where(readable, out, torch.zeros((), dtype=out.dtype, device=out.device)))
