"""Training views of a policy that selects again at every draft step (`DynamicChunkPolicy`).

The deployed cache re-selects the prompt's chunks with each step's own query before that step attends, so in
token-by-token decoding every token reads a different set of prompt keys. One cache cannot hand a block forward a
key set per query; this view keeps the whole prefix (the full-cache branch's `DynamicCache`) and, in the attention
of each layer the deployed cache makes sparse, masks every prefix key outside the chunks the query's own
`choose` keeps (the block's queries scored together, in blocks of bounded memory), and every continuation key the
ring window would have dropped. The selection is not differentiable (as at inference, it reads detached scores);
gradients flow through the attention over the kept keys, the continuation's own keys and values included, as in
the single-selection views.

The view is exact for one-token steps; a deployed step of several tokens selects with its last query for all of
them. `tests/trainer/test_trainer_views.py` checks view logits against token-by-token decoding.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, AttentionMaskInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import eager_mask, sdpa_mask

from ..attention.function_parts import as_additive, family_eager_attention
from ..attention.scoped import using_attention
from ..cache.policies.dynamic import DynamicChunkPolicy

VIEW_PREFIX = "budgetdraft_per_query_view_"
_MASKS = {"sdpa": sdpa_mask, "eager": eager_mask}
_active: ContextVar[PerQueryView | None] = ContextVar("budgetdraft_per_query_view", default=None)
SELECTION_ELEMENTS = 1 << 22  # a bound on one block's chunk scores and gathered key channels (16 MiB of fp32)


@dataclass
class PerQueryView:
    """A sparse view whose prompt selection is made per query.

    Attributes:
        cache (`DynamicCache`): the whole prefix, `(B, H_kv, P, D)` per layer (not mutated: a fresh cache).
        policy (`DynamicChunkPolicy`): the deployed policy; `choose` picks each query's chunks.
        budget (`int`): prompt positions each query reads (as the deployed cache keeps).
        window_length (`int`): the deployed cache's ring window over the continuation.
        prefix_length (`int`): P.
        sparse_layers (`frozenset[int]`): the layers the deployed cache makes sparse (the others read as in the
            full-cache branch: sliding layers keep the model's own mask).
    """

    cache: DynamicCache
    policy: DynamicChunkPolicy
    budget: int
    window_length: int
    prefix_length: int
    sparse_layers: frozenset[int]

    @torch.no_grad()
    def visible(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
        """`(B, H_q, q, P + q)` bool: which keys each of the continuation's queries `(B, H_q, q, D)` (times the
        attention scaling) reads among the layer's keys and values `(B, H_kv, P + q, D)`; None for a layer the
        deployed cache keeps whole."""
        if layer_idx not in self.sparse_layers:
            return None
        length, (batch, heads, num_keys, _) = self.prefix_length, key.shape
        num_queries = query.shape[2]
        if num_keys != length + num_queries:
            raise RuntimeError(
                f"a per-query view reads its prefix of {length} and the block, got {num_keys} keys"
            )
        prompt = torch.ones(batch, heads, num_queries, length, dtype=torch.bool, device=key.device)
        if length > self.budget:  # else the deployed cache keeps the whole prompt
            index = self.policy.index(key[:, :, :length].detach(), value[:, :, :length].detach())
            prompt.zero_()
            # the queries in blocks whose scores `(B, H_kv, block, G, P)` and, for approximate scores, gathered
            # key channels `(B, H_kv, block, r, P)` hold at most SELECTION_ELEMENTS floats
            channels = self.policy.components if self.policy.approximates(key.shape[-1]) else 0
            block = max(1, SELECTION_ELEMENTS // (batch * length * (query.shape[1] + heads * channels)))
            for start in range(0, num_queries, block):
                queries = query[:, :, start : start + block].detach()
                chosen = self.policy.choose(index, queries, self.budget)  # (B, H_kv, block, k)
                prompt[:, :, start : start + block].scatter_(-1, self.policy.positions(chosen, index), True)
        key_pos = torch.arange(length, num_keys, device=key.device)
        query_pos = key_pos[:, None]
        recent = (key_pos <= query_pos) & (key_pos >= query_pos - self.window_length)  # the ring, causal
        visible = torch.cat([prompt, recent.expand(batch, heads, -1, -1)], dim=-1)
        return visible.repeat_interleave(query.shape[1] // heads, dim=1)  # (B, H_q, q, P + q)

    @contextlib.contextmanager
    def reading(self, model) -> Iterator[None]:
        """Run `model` (a `PreTrainedModel` with sdpa or eager attention) through this view inside the block."""
        implementation = model.config._attn_implementation
        if not model._can_set_attn_implementation() or implementation not in _MASKS:
            raise ValueError(
                f"a per-query view (policy={self.policy.name!r}) masks each query's keys in the attention "
                f"function; {type(model).__name__} runs attn_implementation={implementation!r}. Load the drafter "
                "with attn_implementation='sdpa' or 'eager', or train with policy='chunk'"
            )
        _register()
        token = _active.set(self)
        try:
            with using_attention(model, VIEW_PREFIX + implementation):
                yield
        finally:
            _active.reset(token)


def _make_view_attention(base: str):
    def attention(module, query, key, value, attention_mask, **kwargs):
        view = _active.get()
        scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
        visible = None if view is None else view.visible(module.layer_idx, query * scaling, key, value)
        if visible is not None:
            attention_mask = visible if base == "sdpa" else as_additive(visible, query.dtype)
        if base == "sdpa":
            return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        function = family_eager_attention(module, "has no eager_attention_forward; load it with 'sdpa'")
        return function(module, query, key, value, attention_mask, **kwargs)

    attention.__name__ = VIEW_PREFIX + base
    return attention


def _register() -> None:
    """Register `budgetdraft_per_query_view_{sdpa,eager}` (idempotent)."""
    for base, mask in _MASKS.items():
        if VIEW_PREFIX + base not in AttentionInterface._global_mapping:
            AttentionInterface.register(VIEW_PREFIX + base, _make_view_attention(base))
            AttentionMaskInterface.register(VIEW_PREFIX + base, mask)
