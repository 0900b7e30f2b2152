"""`budgetdraft_varlen`: variable-length attention over the sparse key sets a draft reads.

When the key sets of a sparse draft view differ in size per row or per KV head (rings of different fill, per-head
budgets, the stale slots of a static ring), padding them to a rectangle and masking wastes memory traffic on a GPU.
The varlen format instead packs every set back to back, FlashAttention-2 style (Dao, arXiv 2307.08691).

- `backends`: which packed kernel runs (`use_backend`, `resolve_backend`, `available_backends`);
- `packing`: padded key sets <-> the packed format (`pack_keys`, `pack_queries`, `unpack_output`);
- `kernels`: one packed call (`varlen_attention`, `sdpa_varlen`) and the padded-in, padded-out
  `sparse_varlen_attention`;
- `interface`: the transformers attention and mask functions registered as `attn_implementation="budgetdraft_varlen"`.
"""

from .backends import (
    BACKENDS,
    available_backends,
    current_backend,
    flash_attn_available,
    resolve_backend,
    torch_varlen_attn,
    use_backend,
)
from .interface import (
    KEYS_OWNER,
    NAME,
    STATIC_LAYER_KWARG,
    budgetdraft_varlen_attention_forward,
    budgetdraft_varlen_mask,
    register,
)
from .kernels import sdpa_varlen, sparse_varlen_attention, varlen_attention
from .packing import PackedKeys, check_key_valid, pack_keys, pack_queries, unpack_output

__all__ = [
    "BACKENDS",
    "KEYS_OWNER",
    "NAME",
    "STATIC_LAYER_KWARG",
    "PackedKeys",
    "available_backends",
    "budgetdraft_varlen_attention_forward",
    "budgetdraft_varlen_mask",
    "check_key_valid",
    "current_backend",
    "flash_attn_available",
    "pack_keys",
    "pack_queries",
    "register",
    "resolve_backend",
    "sdpa_varlen",
    "sparse_varlen_attention",
    "torch_varlen_attn",
    "unpack_output",
    "use_backend",
    "varlen_attention",
]
