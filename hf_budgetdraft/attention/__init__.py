"""Attention functions registered with transformers by `import hf_budgetdraft`, and query capture.

- `fast_sdpa`: `attn_implementation="budgetdraft_sdpa"`, SDPA without the KV copies of stock `sdpa` (the target
  verifying a few tokens over a long past);
- `varlen`: `attn_implementation="budgetdraft_varlen"`, packed varlen kernels over a draft's sparse key sets and the
  slot-mask step of a static draft cache;
- `query_capture`: hands the prefill queries to a query-scored cache policy (SnapKV);
- `common`: the pieces the attention functions share (GQA without KV repeat, eager fallback, output layout).
"""

from .fast_sdpa import budgetdraft_sdpa_attention_forward, budgetdraft_sdpa_mask, lower_right_causal_mask
from .query_capture import cancel_request, query_capture, request_queries
from .varlen import (
    available_backends,
    budgetdraft_varlen_attention_forward,
    budgetdraft_varlen_mask,
    sparse_varlen_attention,
    use_backend,
    varlen_attention,
)

__all__ = [
    "available_backends",
    "budgetdraft_sdpa_attention_forward",
    "budgetdraft_sdpa_mask",
    "budgetdraft_varlen_attention_forward",
    "budgetdraft_varlen_mask",
    "cancel_request",
    "lower_right_causal_mask",
    "query_capture",
    "request_queries",
    "sparse_varlen_attention",
    "use_backend",
    "varlen_attention",
]
