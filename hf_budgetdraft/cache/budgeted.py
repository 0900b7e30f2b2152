"""`BudgetedCache`: the BudgetDraft draft cache — a fixed budget of selected prefix tokens + recent tokens.

BudgetDraft, arXiv 2606.00144, §3.1. On its first update (the prefill) each layer keeps, per KV head, at most
`budget` prefix positions chosen by a `KeepPolicy` (chunk / streaming / snapkv); tokens after the prefill go
to a ring window of the `window_length` most recent tokens (+ `slack` slots for rolling back a draft round).
The prefill itself attends to the whole prompt; every later query reads `selected prefix + window + own block`.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedConfig

from .base import SparseDraftCache, SparseDraftLayer, check_size
from .policies import KeepPolicy, get_policy
from .prefix_selection import PrefixSelection
from .static import StaticBudgetedLayer, check_static_flag


class BudgetedLayer(PrefixSelection, SparseDraftLayer):
    """Cache layer keeping a policy-selected prefix of at most `budget` tokens + a recent window."""

    def __init__(self, policy: KeepPolicy, budget: int, window_length: int, slack: int, layer_idx: int):
        super().__init__(window_length=window_length, slack=slack, static_capacity=budget)
        self._init_selection(policy, budget, layer_idx)

    def _num_static(self, length: int) -> int:
        self._check_not_pending()
        return self.num_kept

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """First call: prefill `(B, H, L, D)`, attends fully, then the prefix is compressed to the budget.
        Later calls: return `(B, H, kept + window + q, D)` and append the new tokens to the ring."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.prefix_length is None:
            self._prefill(key_states, value_states)
            return key_states, value_states
        keys, values = self._with_past(key_states, value_states)
        self.ring.write(key_states, value_states, self.cumulative_length)
        self.cumulative_length += key_states.shape[-2]
        return keys, values

    def _start_after_prefill(self, length: int) -> None:
        self.cumulative_length = length
        self.ring.restart(length)

    def _store_selection(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.static_keys[:, :, : keys.shape[-2]] = keys
        self.static_values[:, :, : values.shape[-2]] = values

    def crop(self, tokens_to_remove: int) -> None:
        self._set_length(self._length_after_crop(tokens_to_remove))

    def reset(self) -> None:
        super().reset()
        self._reset_selection()


class BudgetedCache(SparseDraftCache):
    """Draft cache keeping at most `budget` prefix tokens per layer and KV head, chosen by `policy`.

    Args:
        config (`PreTrainedConfig`): the config of the model that will run on this cache.
        budget (`int`, defaults to 512): prefix tokens kept per layer and KV head, B.
        policy (`str` or `KeepPolicy`, defaults to `"chunk"`): `"chunk"` (BudgetDraft/TriForce), `"streaming"`,
            `"snapkv"`, or a `KeepPolicy` instance.
        window_length (`int`, defaults to 256): tokens after the prefill kept in the recent window.
        slack (`int`, defaults to 32): the longest draft round that can be rolled back.
        policy_kwargs (`dict`, *optional*): hyper-parameters of a named policy (e.g. `{"chunk_size": 16}`).
        static (`bool`, defaults to `False`): preallocated `[kept prefix | ring]` slot buffers with tensor bookkeeping,
            so a one-token step has fixed shapes (`torch.compile` / CUDA graphs); needs the model to run
            `attn_implementation="budgetdraft_varlen"`. Same keys, same outputs as the dynamic layers.

    Example:
        >>> cache = BudgetedCache(config=drafter.config, budget=64, policy="chunk")
        >>> drafter(prompt_ids, cache=cache)
    """

    def __init__(
        self,
        config: PreTrainedConfig,
        budget: int = 512,
        policy: str | KeepPolicy = "chunk",
        window_length: int = 256,
        slack: int = 32,
        policy_kwargs: dict | None = None,
        static: bool = False,
    ):
        check_size("budget", budget, 1)
        check_size("window_length", window_length, 1)
        check_size("slack", slack, 1)
        check_static_flag(static, config)
        self.policy = get_policy(policy, **(policy_kwargs or {}))
        self.policy.validate_budget(budget)
        self.budget, self.window_length, self.static = budget, window_length, static
        layer_class = StaticBudgetedLayer if static else BudgetedLayer
        super().__init__(
            config, lambda idx: layer_class(self.policy, budget, window_length, slack, layer_idx=idx), slack
        )
