"""`budgetdraft_varlen`: variable-length attention over the sparse key sets a draft reads.

A sparse draft view is a *set* of keys per sequence and KV head: the kept prefix of a budgeted cache (BudgetDraft,
arXiv 2606.00144, §3.1) or the sink + window ring of a sink/window cache (Windowed-MTP, arXiv 2607.21535, §3).
When those sets differ in size per row or per head (rings of different fill, per-head budgets, the stale slots of a
static ring), padding them to a rectangle and masking wastes memory traffic on a GPU. The varlen format instead
packs every set back to back, FlashAttention-2 style (Dao, arXiv 2307.08691):

- a *segment* is one (row, KV-head group): `N = B * H_s` segments, `H_s` = 1 (all KV heads of a row share one key
  set) or `H_kv` (one key set per KV head);
- keys `(T_k, H_kv / H_s, D)` with `cu_seqlens_k = [0, n_0, n_0 + n_1, ...]` (int32, `(N + 1,)`) and
  `max_seqlen_k = max n_i`; queries `(N * q, H_q / H_s, D)` with `cu_seqlens_q = [0, q, 2q, ...]`;
- causal attention is aligned bottom-right (the queries are the last `q` keys of their segment), as flash-attn
  >= 2.1 and `torch.nn.attention.varlen.varlen_attn` align it; GQA is native (query head `i` of a segment reads
  KV head `i // (H_q / H_kv)`), so KV heads are never repeated.

`varlen_attention` dispatches a packed call to `flash_attn_varlen_func` (the `flash-attn` package, CUDA, fp16/bf16),
else PyTorch's own `varlen_attn` (CUDA, fp16/bf16, when this torch has it), else `sdpa_varlen` — a plain SDPA
re-expansion with the same semantics that runs anywhere (the CPU fallback and the test oracle of the packing).
`sparse_varlen_attention` is the padded-in, padded-out wrapper: `pack_keys` / `pack_queries` -> kernel ->
`unpack_output`.

`budgetdraft_varlen_attention_forward` is the transformers attention function (`attn_implementation=
"budgetdraft_varlen"`, registered by `import hf_budgetdraft`):

- steps of a *static* draft cache (`cache_config={"static": True}`; one token, or up to `slack` tokens such as an MTP
  head absorbing a round's verified tokens): the cache layer returns its fixed `[static slots | ring slots]` buffers
  and hands its `(q, slots)` visibility mask to this function through the attention kwargs (`STATIC_LAYER_KWARG`);
  the step runs as one masked SDPA with the query heads folded into rows (no KV repeat, no copy of the window, no
  data-dependent shape: `torch.compile(fullgraph=True)` / CUDA-graph friendly);
- everything else with no mask (a plain lower-right causal block over the keys the cache returned) goes to the
  varlen kernel on CUDA in fp16/bf16 (uniform segments: no packing sync), and to `budgetdraft_sdpa` (the fast CPU
  path) otherwise; a real mask (padding, sliding window, a training view's windowed mask) runs `budgetdraft_sdpa`'s
  masked path. `use_backend("sdpa_packed")` forces the packed path on any device (tests run the whole GPU data path
  on CPU this way).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import causal_mask_function

from .fast_sdpa import (
    _EAGER_ONLY_KWARGS,
    _IGNORED_KWARGS,
    _as_additive,
    _eager_for,
    _grouped,
    _out_layout,
    budgetdraft_sdpa_attention_forward,
    budgetdraft_sdpa_mask,
)

NAME = "budgetdraft_varlen"
STATIC_LAYER_KWARG = "budgetdraft_static_layer"  # attention kwarg a static draft cache layer hands over
BACKENDS = ("auto", "flash_attn", "torch_varlen", "sdpa_packed", "sdpa")
_VARLEN_DTYPES = (torch.float16, torch.bfloat16)
_backend = "auto"


# ---------------------------------------------------------------------------------------------------------------
# Backends
# ---------------------------------------------------------------------------------------------------------------


@functools.cache
def flash_attn_available() -> bool:
    """Whether the `flash-attn` package is importable (it is never imported on CPU-only code paths)."""
    return importlib.util.find_spec("flash_attn") is not None


def _torch_varlen_attn() -> Callable | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.10 has no public varlen attention
        return None
    return varlen_attn


def available_backends() -> dict[str, bool]:
    """Which packed kernels this process can call: `flash_attn` and `torch_varlen` need CUDA; `sdpa_packed` always."""
    cuda = torch.cuda.is_available()
    return {
        "flash_attn": cuda and flash_attn_available(),
        "torch_varlen": cuda and _torch_varlen_attn() is not None,
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
    global _backend
    _check_backend(name)
    previous, _backend = _backend, name
    try:
        yield
    finally:
        _backend = previous


def current_backend() -> str:
    return _backend


def resolve_backend(name: str, query: torch.Tensor) -> str:
    """The packed kernel `name` stands for, for `query`'s device and dtype (`"auto"` -> best available)."""
    _check_backend(name)
    on_cuda_half = query.is_cuda and query.dtype in _VARLEN_DTYPES
    if name == "auto":
        if on_cuda_half and flash_attn_available():
            return "flash_attn"
        if on_cuda_half and _torch_varlen_attn() is not None:
            return "torch_varlen"
        return "sdpa_packed"
    if name in ("flash_attn", "torch_varlen"):
        available = flash_attn_available() if name == "flash_attn" else _torch_varlen_attn() is not None
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


# ---------------------------------------------------------------------------------------------------------------
# Packing
# ---------------------------------------------------------------------------------------------------------------


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


def _check_key_valid(key_valid: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
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
    valid = _check_key_valid(key_valid, key)  # (B, H_s, K)
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


# ---------------------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------------------


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
        return _torch_varlen_attn()(
            query,
            key,
            value,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            scale=scale,
            window_size=(-1, 0) if causal else (-1, -1),
            enable_gqa=query.shape[1] != key.shape[1],
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
        and not bool(_check_key_valid(key_valid, key)[..., -q_length:].all())
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


def masked_sdpa_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_valid: torch.Tensor | None = None,
    *,
    causal: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """What `sparse_varlen_attention` computes, as plain masked SDPA on the padded keys: `(B, q, H_q, D_v)`."""
    batch, num_heads, q_length = query.shape[:3]
    num_kv_heads, kv_length = key.shape[1:3]
    mask = torch.ones(batch, num_kv_heads, q_length, kv_length, dtype=torch.bool, device=query.device)
    if key_valid is not None:
        mask = mask & _check_key_valid(key_valid, key)[:, :, None, :]
    if causal:
        rows = torch.arange(q_length, device=query.device)[:, None] + (kv_length - q_length)
        mask = mask & (torch.arange(kv_length, device=query.device)[None, :] <= rows)
    mask = mask.repeat_interleave(num_heads // num_kv_heads, dim=1)  # (B, H_q, q, K)
    readable = mask.any(dim=-1, keepdim=True)
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask | ~readable, scale=scale, enable_gqa=num_heads != num_kv_heads
    )
    return _out_layout(torch.where(readable, out, torch.zeros((), dtype=out.dtype, device=out.device)))


# ---------------------------------------------------------------------------------------------------------------
# transformers attention interface
# ---------------------------------------------------------------------------------------------------------------


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
    exact slot mask, see `hf_budgetdraft.cache.static`.)
    """
    static_step = isinstance(q_offset, torch.Tensor) and q_length == 1
    if isinstance(q_offset, torch.Tensor) and q_length > 1 and not torch.compiler.is_compiling():
        q_offset = int(q_offset)  # a prefill/block of a static cache: let a plain causal block skip its mask
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


def _needs_eager(module: torch.nn.Module, kwargs: dict) -> bool:
    """Logit softcapping or attention sinks: features only the family's eager attention computes."""
    return any(kwargs.get(name) is not None for name in _EAGER_ONLY_KWARGS) or isinstance(
        getattr(module, "sinks", None), torch.Tensor
    )


def _static_step(module, query, key, value, static_layer, scaling, **kwargs) -> torch.Tensor:
    """Attention of a static draft cache's step (`q` tokens) over its fixed `[static | ring]` buffers."""
    key_valid = static_layer.consume_key_mask()  # (1 or B, 1 or H_kv, q, K): the slots each query may read
    if key_valid.shape[2] != query.shape[2]:
        raise ValueError(
            f"a static draft cache step handed over a slot mask for {key_valid.shape[2]} queries but attention got "
            f"{query.shape[2]}; this is a bug in the static cache layer"
        )
    if _needs_eager(module, kwargs):
        # logit softcapping / attention sinks: the family's own eager attention, the slot mask made additive
        num_heads, num_kv_heads = query.shape[1], key.shape[1]
        mask = (
            key_valid.repeat_interleave(num_heads // num_kv_heads, dim=1)
            if key_valid.shape[1] > 1
            else key_valid
        )
        out, _ = _eager_for(module)(
            module,
            query,
            key,
            value,
            _as_additive(mask, query.dtype),
            dropout=0.0,
            scaling=scaling if scaling is not None else query.shape[-1] ** -0.5,
            **kwargs,
        )
        return out
    packed = _backend in ("flash_attn", "torch_varlen", "sdpa_packed") and not torch.compiler.is_compiling()
    if packed and query.shape[2] == 1:  # one key set per segment: a one-token step
        return sparse_varlen_attention(
            query, key, value, key_valid[:, :, 0], causal=False, scale=scaling, backend=_backend
        )
    # query heads folded into rows: KV read once
    return _out_layout(_grouped(query, key, value, scaling, key_valid))


def _packable(module, query, key, attention_mask, dropout, kwargs) -> bool:
    """Whether a call is a plain (lower-right causal or full) block the packed kernels compute exactly."""
    unknown = any(v is not None and k not in _IGNORED_KWARGS for k, v in kwargs.items())
    return (
        attention_mask is None
        and dropout == 0
        and not unknown
        and not _needs_eager(module, kwargs)
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
    if static_layer is not None:
        return _static_step(module, query, key, value, static_layer, scaling, **kwargs), None
    if _backend != "sdpa" and _packable(module, query, key, attention_mask, dropout, kwargs):
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        backend = resolve_backend(_backend, query)
        # "auto" packs only where a real varlen kernel runs; on CPU budgetdraft_sdpa is the faster exact path
        if backend != "sdpa_packed" or _backend == "sdpa_packed":
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
