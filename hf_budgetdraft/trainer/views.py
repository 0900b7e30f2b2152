"""Training views: what the drafter reads at the continuation positions, built from the *inference caches*.

BudgetDraft, arXiv 2606.00144, §3.2. Per training step:

1. `run_shared_prefix` runs the drafter once over the prefix, without gradient, into a recording cache that keeps
   every layer's prefix keys/values `(B, H_kv, P, D)` (and, for query-scored policies, the last prefill queries).
2. The full-cache branch (L_A) reads a fresh `DynamicCache` holding those keys (`full_cache`).
3. Each sparse view (L_C) is a real `BudgetedCache` / `SinkWindowCache` whose layers are filled by calling their
   own `update(prefix_keys, prefix_values)` — the same code, hence the same policy selection, that runs when the
   deployed drafter prefills a prompt (`SparseViewSpec.build`). The continuation then runs as one block forward
   with gradient through that cache: each layer returns `[kept prefix, ring window, new block]`, and the block is
   causal, which is exactly what token-by-token decoding through the same cache reads while every block token is
   within the cache's recent window. When it is not (a sink/window cache whose window slides during the block, or a
   continuation longer than a budgeted cache's window), `windowed_block_mask` restricts each query to the keys the
   ring would still hold at its position, so the view stays exact. A policy that selects again at every draft step
   (dynamic) has no single selection to build: its view is a `PerQueryView` (`per_query_view.py`).

Cache buffers are stored detached, so gradients flow through the continuation's own keys/values (the block the
layer returns), not into the shared prefix — as in the paper, the prefix is run without gradient.
`tests/trainer/test_trainer_views.py` proves view logits == step-by-step inference logits for every policy.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedConfig
from transformers.cache_utils import Cache, DynamicLayer, get_layer_types_and_kwargs
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from ..attention.query_capture import cancel_request, query_capture, request_queries
from ..cache import BudgetedCache, DraftLayer, KeepPolicy, SinkWindowCache, SparseDraftCache, get_policy
from ..cache.windowed_prefill import recorded, windowed_prefill
from ..compat import cache_kwargs
from .per_query_view import PerQueryView

VIEW_KINDS = ("budgeted", "sink_window")
_SLIDING_TYPES = ("sliding_attention", "chunked_attention")


@dataclass
class SharedPrefix:
    """The drafter's prefix keys/values, computed once per step and shared by every branch and view.

    Attributes:
        keys (`list[torch.Tensor]`): per layer, `(B, H_kv, P, D)` with RoPE applied.
        values (`list[torch.Tensor]`): per layer, `(B, H_kv, P, D)`.
        queries (`list[torch.Tensor | None]`): per full-attention layer, the last `w` prefill queries
            `(B, H_q, w, D)` times the attention scaling (as `KeepPolicy.select` expects); None when not captured.
        length (`int`): P.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    queries: list[torch.Tensor | None]
    length: int


class _PrefixLayer(DynamicLayer):
    """A `DynamicLayer` that keeps the whole prefix (sliding layers too) and can ask for its prefill queries."""

    def __init__(self, layer_idx: int, is_sliding: bool, query_window: int):
        super().__init__()
        self.layer_idx, self.is_sliding, self.query_window = layer_idx, is_sliding, query_window
        self.queries: torch.Tensor | None = None

    def update(self, key_states, value_states, *args, **kwargs):
        if self.is_initialized and self.keys.numel():
            raise RuntimeError("the prefix recorder takes exactly one forward (the prefix)")
        out = super().update(key_states, value_states)
        if self.query_window:
            request_queries(self, self.layer_idx, out[0])  # the keys this update returns
        return out

    def receive_queries(self, queries: torch.Tensor) -> None:
        self.queries = queries[:, :, -self.query_window :].detach()  # (B, H_q, w, D)


def _layer_types(config: PreTrainedConfig) -> list[str]:
    layer_types, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    for idx, layer_type in enumerate(layer_types):
        if layer_type != "full_attention" and layer_type not in _SLIDING_TYPES:
            raise ValueError(
                f"layer {idx} of {config.model_type!r} is {layer_type!r}; BudgetDraft training views support "
                "drafters made of attention layers (full, sliding, chunked). Use a standard decoder as drafter."
            )
    return layer_types


def unwrap_transformers_model(model: torch.nn.Module) -> torch.nn.Module:
    """The `PreTrainedModel` under DDP/FSDP (`.module`) and PEFT (`get_base_model()`) wrappers."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return model


@torch.no_grad()
def run_shared_prefix(
    model: torch.nn.Module,
    prefix_ids: torch.LongTensor,
    query_window: int = 0,
    prefill_window: int | None = None,
    num_sink_tokens: int = 64,
) -> SharedPrefix:
    """Run `model` once over `prefix_ids` `(B, P)` without gradient; return every layer's prefix K/V.

    Args:
        model (`torch.nn.Module`): the drafter (plain, PEFT- or DDP-wrapped).
        prefix_ids (`torch.LongTensor` of shape `(B, P)`): the prefix tokens.
        query_window (`int`, defaults to 0): how many of the last prefill queries to capture per full-attention
            layer (a query-scored policy's `query_window`); 0 captures none.
        prefill_window (`int`, *optional*): run the prefix as `cache_config={"prefill_window": W}` prefills it at
            inference (`cache/windowed_prefill.py`): in chunks of W tokens reading the `num_sink_tokens` sink and
            the W tokens before them. `None`: full attention.
    """
    base = unwrap_transformers_model(model)
    if prefill_window is not None and prefix_ids.shape[1] > prefill_window:
        if query_window:
            raise ValueError(
                "a windowed prefix prefill cannot capture prefill queries for a query-scored policy"
            )
        recorder, _ = windowed_prefill(model, prefix_ids, num_sink_tokens, prefill_window, config=base.config)
        keys, values = recorded(recorder)
        return SharedPrefix(keys=keys, values=values, queries=[None] * len(keys), length=prefix_ids.shape[1])
    layer_types = _layer_types(base.config)
    layers = [
        _PrefixLayer(idx, layer_type in _SLIDING_TYPES, query_window if layer_type == "full_attention" else 0)
        for idx, layer_type in enumerate(layer_types)
    ]
    recorder = Cache(layers=layers)
    capture = query_capture(base) if query_window else contextlib.nullcontext()
    with capture:
        model(input_ids=prefix_ids, **cache_kwargs(recorder), use_cache=True, logits_to_keep=1)
    if query_window and any(layer.query_window and layer.queries is None for layer in layers):
        for layer in layers:
            cancel_request(layer)
        raise RuntimeError("query capture did not deliver the prefill queries of every full-attention layer")
    return SharedPrefix(
        keys=[layer.keys for layer in layers],
        values=[layer.values for layer in layers],
        queries=[layer.queries for layer in layers],
        length=prefix_ids.shape[1],
    )


def full_cache(config: PreTrainedConfig, prefix: SharedPrefix) -> DynamicCache:
    """A fresh `DynamicCache` holding the whole prefix (the full-cache branch; the shared tensors are not mutated)."""
    return DynamicCache(ddp_cache_data=list(zip(prefix.keys, prefix.values, strict=True)), config=config)


@dataclass
class SparseViewSpec:
    """How to build the sparse cache a training view reads: the deployed cache's kind and parameters.

    Args:
        kind (`str`): `"budgeted"` (`BudgetedCache`: a budget of policy-selected prefix tokens + a recent window)
            or `"sink_window"` (`SinkWindowCache`: `num_sink_tokens` + a window of `budget - num_sink_tokens`).
        policy (`str` or `KeepPolicy`): the budgeted cache's selection policy (`"chunk"`, `"streaming"`, `"snapkv"`,
            `"dynamic"`: a `PerQueryView`).
        policy_kwargs (`dict`, *optional*): the named policy's hyper-parameters.
        window_length (`int`): the budgeted cache's recent window (match the deployed `cache_config`).
        num_sink_tokens (`int`): the sink of a `"sink_window"` view.
        slack (`int`): the rollback slack (does not change what a query reads).
    """

    kind: str = "budgeted"
    policy: str | KeepPolicy = "chunk"
    policy_kwargs: dict | None = None
    window_length: int = 256
    num_sink_tokens: int = 64
    slack: int = 32

    def __post_init__(self):
        if self.kind not in VIEW_KINDS:
            raise ValueError(f"view kind must be one of {VIEW_KINDS}, got {self.kind!r}")
        self.policy = get_policy(self.policy, **(self.policy_kwargs or {}))
        self.policy_kwargs = None  # folded into the policy instance

    @property
    def query_window(self) -> int:
        """Prefill queries the view's selection reads (0 unless a query-scored budgeted policy)."""
        if self.kind == "budgeted" and self.policy.needs_queries:
            return self.policy.query_window
        return 0

    def make_cache(self, config: PreTrainedConfig, budget: int) -> SparseDraftCache:
        """An empty cache of this kind; `cache_config` equivalent: see `cache_config(budget)`."""
        if self.kind == "budgeted":
            return BudgetedCache(
                config, budget=budget, policy=self.policy, window_length=self.window_length, slack=self.slack
            )
        return SinkWindowCache(
            config,
            num_sink_tokens=self.num_sink_tokens,
            window_length=budget - self.num_sink_tokens,
            slack=self.slack,
        )

    def build(
        self, config: PreTrainedConfig, prefix: SharedPrefix, budget: int
    ) -> SparseDraftCache | PerQueryView:
        """A cache of this kind at `budget`, holding exactly what the deployed cache holds after prefilling the
        prefix: each layer's own `update` runs on the shared prefix keys (and the policy on its queries). A policy
        that selects at every step (dynamic) gets a `PerQueryView` instead: each query reads its own selection."""
        cache = self.make_cache(config, budget)
        if self.kind == "budgeted" and self.policy.refreshes:
            sparse = frozenset(idx for idx, layer in enumerate(cache.layers) if isinstance(layer, DraftLayer))
            return PerQueryView(
                full_cache(config, prefix), self.policy, budget, self.window_length, prefix.length, sparse
            )
        needs_queries = self.query_window > 0
        for idx, layer in enumerate(cache.layers):
            layer.update(prefix.keys[idx], prefix.values[idx])
            if needs_queries and isinstance(layer, DraftLayer):
                if prefix.queries[idx] is None:
                    cancel_request(layer)
                    raise ValueError(
                        f"policy={self.policy.name!r} needs prefill queries; run the prefix with "
                        f"run_shared_prefix(..., query_window={self.query_window})"
                    )
                layer.receive_queries(prefix.queries[idx])  # no-op when the prefix fits the budget
                cancel_request(layer)
        return cache


def windowed_block_mask(
    model: torch.nn.Module, cache: SparseDraftCache, batch_size: int, block_length: int
) -> torch.Tensor | None:
    """The attention mask of a `block_length`-token block read through a prefilled `cache`, or None when the
    standard causal mask is already exact.

    Token-by-token decoding lets the query at position `p` read the cache's static keys (kept prefix or sink) and
    the ring positions `[p - W, p)` plus itself, `W` the ring window. A block forward returns
    `[static, ring window at the block start, block]` keys; this mask hides from query `p` each non-static key
    older than `p - W`. Returns a 4D mask `(B, 1, block_length, num_keys)` in the format of the model's attention
    implementation.
    """
    sparse = [layer for layer in cache.layers if isinstance(layer, DraftLayer)]
    layer = sparse[0]
    length, window = layer.get_seq_length(), layer.ring.window
    num_past = layer.num_visible_past()
    num_ring = layer.ring.num_visible(length)
    num_static = num_past - num_ring
    if any(other.num_visible_past() != num_past for other in sparse):
        raise RuntimeError("sparse cache layers disagree on how many past keys they hold")

    device = layer.keys.device
    key_pos = torch.arange(length - num_ring, length + block_length, device=device)  # ring + block positions
    query_pos = torch.arange(length, length + block_length, device=device)
    causal = key_pos[None, :] <= query_pos[:, None]  # (q, ring + block)
    in_window = key_pos[None, :] >= query_pos[:, None] - window
    if bool((causal & ~in_window).sum() == 0):
        return None  # every causal key is still in the window: the model's own causal mask is exact
    if len(sparse) != len(cache.layers):
        raise ValueError(
            f"this view slides its window during the continuation (window {window} tokens, {block_length}-token "
            "continuation, ring already holding prefix tokens), which needs a custom mask, but the drafter also has "
            "sliding-window layers that need their own. Use budgeted views with window_length >= "
            "continuation_length, or a drafter with full-attention layers only."
        )
    visible = torch.cat(
        [torch.ones(block_length, num_static, dtype=torch.bool, device=device), causal & in_window], dim=1
    )  # (q, K)

    def mask_function(batch_idx, head_idx, q_idx, kv_idx):
        return visible[q_idx, kv_idx]

    config = unwrap_transformers_model(model).config
    implementation = config._attn_implementation
    make_mask = ALL_MASK_ATTENTION_FUNCTIONS.get(implementation, None)
    mask = None
    if make_mask is not None:
        mask = make_mask(
            batch_size=batch_size,
            q_length=block_length,
            kv_length=visible.shape[1],
            mask_function=mask_function,
            allow_is_causal_skip=False,
            dtype=next(model.parameters()).dtype,
            device=device,
            config=config,
        )
    if mask is None or len(mask.shape) != 4:
        raise ValueError(
            f"attn_implementation={implementation!r} cannot take the windowed mask this view needs; load the "
            "drafter with attn_implementation='sdpa' or 'eager' (or use budgeted views with window_length >= "
            "continuation_length)"
        )
    return mask


def view_logits(
    model: torch.nn.Module, continuation_ids: torch.LongTensor, cache: Cache | PerQueryView
) -> torch.Tensor:
    """Drafter logits `(B, C, V)` at the continuation positions, read through a prefilled `cache` in one block.

    With gradient enabled, gradients reach the drafter through the continuation's own queries, keys and values.
    """
    if isinstance(cache, PerQueryView):
        with cache.reading(unwrap_transformers_model(model)):
            return model(input_ids=continuation_ids, **cache_kwargs(cache.cache), use_cache=True).logits
    mask = None
    if isinstance(cache, SparseDraftCache):
        mask = windowed_block_mask(model, cache, *continuation_ids.shape)
    out = model(input_ids=continuation_ids, **cache_kwargs(cache), use_cache=True, attention_mask=mask)
    return out.logits
