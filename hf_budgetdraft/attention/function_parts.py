"""Pieces both attention functions (`budgetdraft_sdpa`, `budgetdraft_varlen`) are built from.

Shapes follow transformers' attention interface: queries `(B, H_q, q, D)` (RoPE applied), keys/values
`(B, H_kv, kv, D)` / `(B, H_kv, kv, D_v)` as the cache layer returns them, `H_q % H_kv == 0` (GQA), and an attention
output `(B, q, H_q, D_v)` that every modeling file reshapes to `(B, q, H_q * D_v)`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

# Keyword arguments the modeling files pass that change nothing for SDPA (the mask already encodes them).
IGNORED_KWARGS = frozenset(
    {
        "sliding_window",  # encoded in the mask (budgetdraft_sdpa_mask never skips a local mask)
        "position_ids",
        "cache_position",
        "use_cache",
        "layer_idx",
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
        "output_attentions",
        "output_hidden_states",  # passed down by generate(use_mtp=True)'s verification; attention ignores it
        "return_dict",
        "is_causal",
        "position_embeddings",
        "cache",
        "past_key_values",
    }
)
# Keyword arguments of features only a family's eager attention computes (logit softcapping, attention sinks).
EAGER_ONLY_KWARGS = ("softcap", "s_aux", "sinks")


def needs_eager(module: torch.nn.Module, kwargs: dict) -> bool:
    """Whether the call asks for logit softcapping or attention sinks (a `sinks` parameter on the module, as in
    gpt-oss): features SDPA cannot compute, which only the family's own `eager_attention_forward` does."""
    return any(kwargs.get(name) is not None for name in EAGER_ONLY_KWARGS) or isinstance(
        getattr(module, "sinks", None), torch.Tensor
    )


def family_eager_attention(module: torch.nn.Module, missing: str) -> Callable:
    """The `eager_attention_forward` of `module`'s modeling file (each family writes its own: softcapping, sinks,
    ...); raises `ValueError(f"{type(module).__name__} {missing}")` when that file has none."""
    family_eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if family_eager is None:
        raise ValueError(f"{type(module).__name__} {missing}")
    return family_eager


# What `budgetdraft_sdpa` / `budgetdraft_varlen` say when a feature needs an eager attention the family lacks.
_NO_EAGER_FALLBACK = (
    "asks for logit softcapping or attention sinks, which SDPA cannot compute, and its modeling file has no "
    "eager_attention_forward to fall back to; load the model with attn_implementation='eager' instead of "
    "'budgetdraft_sdpa'"
)


def eager_fallback(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    dropout: float,
    scaling: float | None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The family's own eager attention on a bool or additive `mask` (`(B, 1 or H_q, q, kv)`), for logit
    softcapping and attention sinks; returns its `(attn_output (B, q, H_q, D_v), attn_weights)`."""
    return family_eager_attention(module, _NO_EAGER_FALLBACK)(
        module,
        query,
        key,
        value,
        as_additive(mask, query.dtype),
        dropout=dropout,
        scaling=scaling if scaling is not None else query.shape[-1] ** -0.5,
        **kwargs,
    )


def as_additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A bool mask (`True` = attend) as the additive float mask eager attention adds to its logits (0 or the
    dtype's minimum); a float mask or `None` passes through."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.where(mask, torch.zeros((), dtype=dtype, device=mask.device), torch.finfo(dtype).min)


def out_layout(attn_output: torch.Tensor) -> torch.Tensor:
    """`(B, H_q, q, D_v)` -> `(B, q, H_q, D_v)` contiguous: the layout every modeling file reshapes to
    `(B, q, H_q * D_v)`."""
    return attn_output.transpose(1, 2).contiguous()


def grouped_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None,
    key_valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of `(B, H_q, q, D)` queries over `(B, H_kv, kv, D)` keys without repeating KV.

    The `G = H_q / H_kv` query heads of each KV head are folded into rows, `(B, H_kv, G * q, D)` (row `g * q + i` is
    query `i` of group member `g`), so one SDPA call reads each KV head once.

    Args:
        query (`torch.Tensor` of shape `(B, H_q, q, D)`).
        key, value (`torch.Tensor` of shape `(B, H_kv, kv, D)` / `(B, H_kv, kv, D_v)`).
        scaling (`float`, *optional*): softmax scale, `D ** -0.5` if `None`.
        key_valid (`torch.BoolTensor` of shape `(1 or B, 1 or H_kv, q, kv)`, *optional*): the keys each query may
            read; no mask (every query reads every key) otherwise.

    Returns:
        `torch.Tensor` of shape `(B, H_q, q, D_v)`.
    """
    batch, num_heads, q_length, _ = query.shape
    groups = num_heads // key.shape[1]
    grouped = query.reshape(batch, key.shape[1], groups * q_length, query.shape[-1])
    if key_valid is not None and q_length > 1:
        key_valid = key_valid.repeat(1, 1, groups, 1)  # row g*q + i reads query i's keys
    out = F.scaled_dot_product_attention(grouped, key, value, attn_mask=key_valid, scale=scaling)
    return out.reshape(batch, num_heads, q_length, value.shape[-1])
