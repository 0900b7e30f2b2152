"""`budgetdraft_varlen`: the transformers attention function over the sparse key sets a draft reads.

A sparse draft view is a *set* of keys per sequence and KV head: the kept prefix of a budgeted cache (BudgetDraft,
arXiv 2606.00144, §3.1) or the sink + window ring of a sink/window cache (Windowed-MTP, arXiv 2607.21535, §3).
`attn_implementation="budgetdraft_varlen"` (registered by `import hf_budgetdraft`) computes what `sdpa` computes on
those keys:

- steps of a *static* draft cache (`cache_config={"static": True}`; one token, or up to `slack` tokens such as an MTP
  head absorbing a round's verified tokens): the cache layer returns its fixed `[static slots | ring slots]` buffers
  and hands its `(q, slots)` visibility mask to this function through the attention kwargs (`STATIC_LAYER_KWARG`;
  where the attention passes no kwargs to the cache, this function finds the layer through the key buffer it is
  handed, `KEYS_OWNER`, as a layer reusing those keys does);
  the step runs as one masked SDPA with the query heads folded into rows (no KV repeat, no copy of the window, no
  data-dependent shape: `torch.compile(fullgraph=True)` / CUDA-graph friendly);
- everything else with no mask (a plain lower-right causal block over the keys the cache returned) goes to the
  varlen kernel on CUDA in fp16/bf16 (uniform segments: no packing sync), and to `budgetdraft_sdpa` (the fast CPU
  path) otherwise; a real mask (padding, sliding window, a training view's windowed mask) runs `budgetdraft_sdpa`'s
  masked path. `use_backend("sdpa_packed")` forces the packed path on any device (tests run the whole GPU data path
  on CPU this way).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import causal_mask_function

from ..fast_sdpa import budgetdraft_sdpa_attention_forward, budgetdraft_sdpa_mask
from ..function_parts import (
    IGNORED_KWARGS,
    eager_fallback,
    grouped_attention,
    needs_eager,
    out_layout,
)
from .backends import PACKED_BACKENDS, current_backend, resolve_backend
from .kernels import sparse_varlen_attention

NAME = "budgetdraft_varlen"
STATIC_LAYER_KWARG = "budgetdraft_static_layer"  # attention kwarg a static draft cache layer hands over
KEYS_OWNER = "budgetdraft_keys_owner"  # attribute of a static draft cache layer's key buffer: the layer


def budgetdraft_varlen_mask(
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
    """Mask function of `budgetdraft_varlen` (registered with `AttentionMaskInterface`): `budgetdraft_sdpa_mask`'s
    masks (None for a plain lower-right causal block, else a materialised `(B, 1, q, kv)` bool mask).

    A tensor `q_offset` comes from a compileable cache (a static draft cache, transformers' `StaticCache`): for a
    one-token step the mask is then always materialised, so every decode step hands the compiled forward an input of
    the same type and shape; for a block outside compilation it is read as an int, so a plain causal prefill still
    skips its `(q, kv)` mask. (A static draft cache's one-token step ignores this mask: its layer hands over the
    exact slot mask, see `hf_budgetdraft.cache.static_draft_layer`.)
    """
    static_step = isinstance(q_offset, torch.Tensor) and q_length == 1
    if isinstance(q_offset, torch.Tensor) and q_length > 1 and not torch.compiler.is_compiling():
        q_offset = int(q_offset)  # a prefill/block of a static cache: let a plain causal block skip its mask
    # A static layer's step reports its slots as the keys (offset 0) while its queries keep their positions, past
    # them; it reads the slot mask it hands over, not this one. Placing its queries last keeps a mask function that
    # indexes per-position ids (Gemma 4's vision blocks, padded to the keys) in range. Every other layer's queries
    # end where its keys end, or before: for them this changes nothing.
    last = kv_offset + kv_length - q_length
    q_offset = torch.clamp(q_offset, max=last) if isinstance(q_offset, torch.Tensor) else min(q_offset, last)
    return budgetdraft_sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=mask_function,
        attention_mask=attention_mask,
        local_size=local_size,
        allow_is_causal_skip=allow_is_causal_skip and not static_step,
        **kwargs,
    )


def _static_step(module, query, key, value, static_layer, scaling, **kwargs) -> torch.Tensor:
    """Attention of a static draft cache's step (`q` tokens) over its fixed `[static | ring]` buffers (a selection
    that refreshes re-selects its static slots with the step's queries first)."""
    static_layer.before_attention(query, scaling if scaling is not None else query.shape[-1] ** -0.5)
    return _slot_attention(module, query, key, value, static_layer.consume_key_mask(), scaling, **kwargs)


def _slot_attention(module, query, key, value, key_valid, scaling, **kwargs) -> torch.Tensor:
    """Attention over a static draft cache layer's slot buffers, each query reading the slots `key_valid`
    `(1 or B, 1 or H_kv, q, K)` marks."""
    if kwargs.get("position_bias") is not None:
        raise ValueError(
            f"{type(module).__name__} adds a position bias built on contiguous key positions, which a static draft "
            "cache's slots are not (drafts would silently read the wrong bias); use cache_config={'static': False}"
        )
    if key_valid.shape[2] != query.shape[2]:
        raise ValueError(
            f"a static draft cache step handed over a slot mask for {key_valid.shape[2]} queries but attention got "
            f"{query.shape[2]}; this is a bug in the static cache layer"
        )
    if needs_eager(module, kwargs):
        # logit softcapping / attention sinks: the family's own eager attention, the slot mask made additive
        num_heads, num_kv_heads = query.shape[1], key.shape[1]
        mask = (
            key_valid.repeat_interleave(num_heads // num_kv_heads, dim=1)
            if key_valid.shape[1] > 1
            else key_valid
        )
        return eager_fallback(module, query, key, value, mask, 0.0, scaling, **kwargs)[0]
    pinned = current_backend()
    if pinned in PACKED_BACKENDS and not torch.compiler.is_compiling() and query.shape[2] == 1:
        # one key set per segment: a one-token step
        return sparse_varlen_attention(
            query, key, value, key_valid[:, :, 0], causal=False, scale=scaling, backend=pinned
        )
    # query heads folded into rows: KV read once
    return out_layout(grouped_attention(query, key, value, scaling, key_valid))


def _packable(module, query, key, attention_mask, dropout, kwargs) -> bool:
    """Whether a call is a plain (lower-right causal or full) block the packed kernels compute exactly."""
    unknown = any(v is not None and k not in IGNORED_KWARGS for k, v in kwargs.items())
    return (
        attention_mask is None
        and dropout == 0
        and not unknown
        and not needs_eager(module, kwargs)
        and query.shape[2] <= key.shape[2]
        and query.shape[0] == key.shape[0]
        and query.shape[-1] == key.shape[-1]
        and query.shape[1] % key.shape[1] == 0
    )


def budgetdraft_varlen_attention_forward(
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
    """Attention function registered as `budgetdraft_varlen` (same contract as transformers' `sdpa`).

    Args:
        module (`torch.nn.Module`): the attention module.
        query (`torch.Tensor`): `(B, H_q, q, D)`, RoPE applied.
        key (`torch.Tensor`): `(B, H_kv, kv, D)` as returned by the cache layer.
        value (`torch.Tensor`): `(B, H_kv, kv, D_v)`.
        attention_mask (`torch.Tensor`, *optional*): from `budgetdraft_varlen_mask` (None = plain lower-right causal).
        dropout (`float`): attention dropout (a nonzero value takes the SDPA path).
        scaling (`float`, *optional*): softmax scale.
        is_causal (`bool`, *optional*): overrides `module.is_causal`.

    Returns:
        `(attn_output (B, q, H_q, D_v), None)`.
    """
    static_layer = kwargs.pop(STATIC_LAYER_KWARG, None)
    # the static draft cache layer whose step returned these keys, if any
    owner = getattr(key, KEYS_OWNER, None)
    reusing = getattr(module, "is_kv_shared_layer", False)
    if static_layer is None and owner is not None and not reusing:
        # an attention that passes no kwargs to `cache.update` (GPT-NeoX; transformers < 5.24)
        static_layer = owner
    if static_layer is not None:
        return _static_step(module, query, key, value, static_layer, scaling, **kwargs), None
    if owner is not None:
        # a layer reusing an earlier layer's keys (Gemma 3n / Gemma 4): that step's last queries, since Gemma 4 runs
        # its reusing layers on the positions whose logits are kept only
        key_valid = owner.step_key_mask()[:, :, -query.shape[2] :]
        return _slot_attention(module, query, key, value, key_valid, scaling, **kwargs), None
    pinned = current_backend()
    if pinned != "sdpa" and _packable(module, query, key, attention_mask, dropout, kwargs):
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        backend = resolve_backend(pinned, query)
        # "auto" packs only where a real varlen kernel runs; on CPU budgetdraft_sdpa is the faster exact path
        if backend != "sdpa_packed" or pinned == "sdpa_packed":
            out = sparse_varlen_attention(
                query, key, value, None, causal=causal and query.shape[2] > 1, scale=scaling, backend=backend
            )
            return out, None
    return budgetdraft_sdpa_attention_forward(
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


def register() -> None:
    """Register `budgetdraft_varlen` with transformers' attention and mask interfaces (idempotent)."""
    if NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(NAME, budgetdraft_varlen_attention_forward)
    if NAME not in AttentionMaskInterface._global_mapping:
        AttentionMaskInterface.register(NAME, budgetdraft_varlen_mask)
