"""`budgetdraft_sdpa`: SDPA attention that keeps verifying a few tokens over a long past cheap on CPU.

Select it with `model.set_attn_implementation("budgetdraft_sdpa")` or `from_pretrained(...,
attn_implementation="budgetdraft_sdpa")` (registered by `import hf_budgetdraft`). It computes what transformers'
`sdpa` computes (same inputs, same `(attn_output, None)` output) without the two copies that make stock `sdpa`
verification slow at long context on CPU (`benchmarks/verify_cost.py`; `benchmarks/results/verify_cost.md`):

- **GQA without repeating KV.** Stock `sdpa` repeats every KV head `num_key_value_groups` times whenever a mask is
  passed and `q_len > 1` — a copy of the whole cache per layer and step. Here the query heads of one KV head are
  folded into the query-length axis, `(B, H_q, q, D) -> (B, H_kv, G * q, D)`, or SDPA's `enable_gqa` is used.
- **No `(q, kv)` mask for a plain causal block.** For `q` new tokens after a past of `P = kv - q` tokens (cache
  layers return `[past, new]`), the mask function returns `None` instead of a materialised lower-right causal mask,
  and the attention is split: the past (every new query sees all of it, no mask) and the new block (causal,
  `q x q`), each with its log-sum-exp, merged exactly:
  `out = out_new + sigmoid(lse_past - lse_new) * (out_past - out_new)`.
- **Ragged batches row by row.** Inside `ragged_rows(cache)` (the batched speculative loop), a full-attention layer
  of that cache attends each row's needed queries over its own keys with the two paths above, ignoring the mask
  (`ragged_rows.py`): no key past a row's length is read, and a row verifying one token pays for one query.

Everything else goes to a reference path, never to an approximation: a real mask (left padding, sliding window,
static cache, packed sequences) runs masked SDPA (with `enable_gqa` on CPU); dropout, `position_bias`,
`output_attentions` and keyword arguments this function does not know run transformers' own `sdpa` on an
equivalent materialised mask; logit softcapping and attention sinks (which stock `sdpa` rejects or ignores) run
the model family's own `eager_attention_forward`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import causal_mask_function, sdpa_mask
from transformers.utils.import_utils import is_torch_greater_or_equal

from .function_parts import (
    IGNORED_KWARGS,
    eager_fallback,
    grouped_attention,
    needs_eager,
    out_layout,
)
from .ragged_rows import active_row_spans, row_by_row_attention

NAME = "budgetdraft_sdpa"

# aten's CPU flash kernel: returns the log-sum-exp next to the output, what the exact split-and-merge needs
_flash_with_lse = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
# before torch 2.9 that kernel reads past the key heads when a block has fewer of them than the query has heads
_KERNEL_GQA_EXACT = is_torch_greater_or_equal("2.9")


def budgetdraft_sdpa_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | torch.Tensor = 0,
    kv_offset: int = 0,
    mask_function: Callable = causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    local_size: int | None = None,
    allow_is_causal_skip: bool = True,
    **kwargs,
) -> torch.Tensor | None:
    """Mask function of `budgetdraft_sdpa` (registered with `AttentionMaskInterface`).

    Returns `None` exactly when the mask would be a plain lower-right causal block: causal mask function, no local
    window, no padding, and the queries are the last `q_length` of the `kv_length` keys
    (`q_offset + q_length == kv_offset + kv_length`, true for `DynamicCache`, `GrowableCache` and the sparse draft
    caches). `budgetdraft_sdpa_attention_forward` reads `None` as that block. Otherwise it returns transformers'
    own `sdpa_mask`, always materialised: a `(batch_size, 1, q_length, kv_length)` bool mask (`True` = attend),
    so `None` never means the upper-left alignment stock `sdpa` uses for an empty static cache.

    Args:
        batch_size (`int`): batch size.
        q_length (`int`): number of queries.
        kv_length (`int`): number of keys the cache layer returns.
        q_offset (`int` or `torch.Tensor`): position of the first query.
        kv_offset (`int`): position of the first key.
        mask_function (`Callable`): transformers' mask pattern (causal, sliding, chunked, ...).
        attention_mask (`torch.Tensor`, *optional*): 2D padding mask `(batch_size, >= kv_offset + kv_length)`.
        local_size (`int`, *optional*): sliding window / chunk size of a local-attention layer.
        allow_is_causal_skip (`bool`): whether the caller allows returning `None` for a causal mask.
    """
    plain_causal = (
        allow_is_causal_skip
        and mask_function is causal_mask_function
        and local_size is None
        and isinstance(q_offset, int)
        and isinstance(kv_offset, int)
        and q_offset + q_length == kv_offset + kv_length
        and (attention_mask is None or bool(attention_mask.all()))
    )
    if plain_causal:
        return None
    return sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=mask_function,
        attention_mask=attention_mask,
        local_size=local_size,
        allow_is_causal_skip=False,
        **kwargs,
    )


def lower_right_causal_mask(q_length: int, kv_length: int, device: torch.device) -> torch.Tensor:
    """The mask `budgetdraft_sdpa_mask`'s `None` stands for: `(1, 1, q_length, kv_length)` bool, query `i` sees key
    `j` iff `j <= i + kv_length - q_length` (the queries are the last `q_length` keys)."""
    q_pos = torch.arange(q_length, device=device)[:, None] + (kv_length - q_length)  # (q, 1)
    kv_pos = torch.arange(kv_length, device=device)[None, :]  # (1, kv)
    return (kv_pos <= q_pos)[None, None]  # (1, 1, q, kv)


def _split_past_and_block(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling
) -> torch.Tensor:
    """Lower-right causal attention of `q` new queries over `[past, new]` keys, split and merged by log-sum-exp.

    Shapes: query `(B, H_q, q, D)`, key/value `(B, H_kv, P + q, D)`; returns `(B, H_q, q, D)`.
    """
    batch, num_heads, q_length, head_dim = query.shape
    num_kv_heads, past = key.shape[1], key.shape[2] - q_length
    groups = num_heads // num_kv_heads
    # past: every new query sees every past key -> no mask; query heads folded into rows, KV read once per KV head
    grouped = query.reshape(batch, num_kv_heads, groups * q_length, head_dim)  # (B, H_kv, G*q, D)
    out_past, lse_past = _flash_with_lse(
        grouped, key[:, :, :past], value[:, :, :past], 0.0, False, scale=scaling
    )  # (B, H_kv, G*q, D), (B, H_kv, G*q)
    out_past = out_past.reshape(batch, num_heads, q_length, head_dim)
    lse_past = lse_past.reshape(batch, num_heads, q_length)
    # new block: q x q, causal (upper-left == lower-right for a square block); GQA by the kernel where it is exact
    new_keys, new_values = key[:, :, past:], value[:, :, past:]
    if groups > 1 and not _KERNEL_GQA_EXACT:
        new_keys, new_values = (t.repeat_interleave(groups, dim=1) for t in (new_keys, new_values))
    out_new, lse_new = _flash_with_lse(
        query, new_keys, new_values, 0.0, True, scale=scaling
    )  # (B, H_q, q, D), (B, H_q, q)
    # softmax over the union = convex combination weighted by each part's share of the total exp-mass
    weight_past = torch.sigmoid(lse_past - lse_new).unsqueeze(-1)  # (B, H_q, q, 1)
    merged = out_new.float() + weight_past * (out_past.float() - out_new.float())
    return merged.to(query.dtype)


def _can_split(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    return (
        _flash_with_lse is not None
        and query.device.type == "cpu"
        and query.dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64)
        and key.shape[-1] == value.shape[-1] == query.shape[-1]
        and query.shape[0] == key.shape[0]
        # the log-sum-exp output carries no gradient: training takes the public path
        and not (
            torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
        )
    )


def budgetdraft_sdpa_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention function registered as `budgetdraft_sdpa` (same contract as transformers' `sdpa`).

    Args:
        module (`torch.nn.Module`): the attention module (read for `is_causal` and family-specific features).
        query (`torch.Tensor`): `(B, H_q, q, D)`, RoPE applied.
        key (`torch.Tensor`): `(B, H_kv, kv, D)` as returned by the cache layer (`H_q % H_kv == 0`).
        value (`torch.Tensor`): `(B, H_kv, kv, D_v)`.
        attention_mask (`torch.Tensor`, *optional*): `(B, 1, q, kv)` bool/float mask from
            `budgetdraft_sdpa_mask`; `None` means a lower-right causal block (no padding).
        dropout (`float`): attention dropout probability (non-zero only in training).
        scaling (`float`, *optional*): softmax scale, `D ** -0.5` if `None`.
        is_causal (`bool`, *optional*): overrides `module.is_causal`.

    Returns:
        `tuple[torch.Tensor, None]`: attention output `(B, q, H_q, D_v)` (contiguous) and no attention weights.
    """
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # Like stock sdpa, trust the mask for local windows (`budgetdraft_sdpa_mask` materialises every local mask).
    if needs_eager(module, kwargs) or _needs_stock_sdpa(dropout, kwargs):
        return _reference_attention(
            module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs
        )
    num_heads, num_kv_heads = query.shape[1], key.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(
            f"budgetdraft_sdpa needs the query heads to be a multiple of the key/value heads, got "
            f"{num_heads} query heads and {num_kv_heads} key/value heads; check the model config"
        )
    spans = active_row_spans(module, query, key) if is_causal else None
    if spans is not None:  # a ragged batch on CPU: each row over its own keys, the mask is not needed
        return out_layout(row_by_row_attention(query, key, value, scaling, spans, _causal_unmasked)), None
    if attention_mask is not None:
        return _masked_attention(module, query, key, value, attention_mask, scaling, is_causal, **kwargs)
    return out_layout(_unmasked_attention(query, key, value, scaling, is_causal)), None


def _needs_stock_sdpa(dropout: float, kwargs: dict) -> bool:
    """Features stock `sdpa` handles and the fast paths do not: dropout, `position_bias`, `output_attentions`,
    keyword arguments this module does not know."""
    unknown = any(v is not None and k not in IGNORED_KWARGS for k, v in kwargs.items())
    return (
        dropout > 0
        or kwargs.get("position_bias") is not None
        or bool(kwargs.get("output_attentions"))
        or unknown
    )


def _reference_attention(
    module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The family's eager attention (softcapping, sinks) or stock `sdpa`, on the mask `None` stands for."""
    eager_only = needs_eager(module, kwargs)
    q_length, kv_length = query.shape[2], key.shape[2]
    if attention_mask is None and is_causal and q_length > 1 and (eager_only or q_length < kv_length):
        # spell out what `None` means: eager has no causal flag, stock sdpa would align it upper-left
        attention_mask = lower_right_causal_mask(q_length, kv_length, query.device)
    if eager_only:
        return eager_fallback(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    return sdpa_attention_forward(
        module,
        query,
        key,
        value,
        attention_mask,
        dropout=dropout,
        scaling=scaling,
        is_causal=is_causal,
        **kwargs,
    )


def _masked_attention(
    module, query, key, value, attention_mask, scaling, is_causal, **kwargs
) -> tuple[torch.Tensor, None]:
    """A real mask (padding, sliding window, static cache, packing): masked SDPA, KV not repeated on CPU."""
    if query.device.type != "cpu":  # masked GQA may leave the fused kernels elsewhere: keep stock behaviour
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, is_causal=is_causal, **kwargs
        )
    gqa = query.shape[1] != key.shape[1]
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=gqa
    )
    return out_layout(out), None


def _unmasked_attention(query, key, value, scaling, is_causal: bool) -> torch.Tensor:
    """No mask: non-causal, one query, a prefill, or a block of `q` new tokens after a past. `(B, H_q, q, D_v)`."""
    q_length, kv_length = query.shape[2], key.shape[2]
    gqa = query.shape[1] != key.shape[1]
    if not is_causal or q_length == 1:
        return grouped_attention(query, key, value, scaling)
    if q_length == kv_length:
        return F.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scaling, enable_gqa=gqa
        )
    if q_length > kv_length:
        raise ValueError(
            f"budgetdraft_sdpa got {q_length} queries but only {kv_length} keys with a causal module and no mask; "
            "the cache layer must return the new tokens' keys too (kv_length >= q_length)"
        )
    if _can_split(query, key, value):
        return _split_past_and_block(query, key, value, scaling)
    mask = lower_right_causal_mask(q_length, kv_length, query.device)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=gqa)


def _causal_unmasked(query, key, value, scaling) -> torch.Tensor:
    return _unmasked_attention(query, key, value, scaling, is_causal=True)


def register() -> None:
    """Register `budgetdraft_sdpa` with transformers' attention and mask interfaces (idempotent)."""
    if NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(NAME, budgetdraft_sdpa_attention_forward)
    if NAME not in AttentionMaskInterface._global_mapping:
        AttentionMaskInterface.register(NAME, budgetdraft_sdpa_mask)
