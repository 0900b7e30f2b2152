"""Sparse reads of a shared-KV assistant: a Gemma 4 assistant drafts on a sink + window (Windowed-MTP) or on a
budgeted selection + window (BudgetDraft) of the target's full-attention keys/values.

transformers drafts with a Gemma 4 assistant (`Gemma4AssistantForCausalLM`, or the unified one) through
`SinglePositionMultiTokenCandidateGenerator`: it has no cache of its own; each draft step's queries attend to the
target's `shared_kv_states`, the keys/values of the target's last sliding and last full-attention layer over the
whole context. The sliding ones are bounded by the target's window; the full-attention ones grow with the context,
the draft-KV tax. Here, before each round, the full-attention states are cut to what the draft cache of the same
name would hold:

- `sink_window` (Windowed-MTP, arXiv 2607.21535): their first `num_sink_tokens` positions and their last
  `window_length` verified ones (views: nothing is copied or kept between rounds);
- `budgeted` (BudgetDraft, arXiv 2606.00144, §3.1): per KV head, the `budget` prompt positions a `KeepPolicy`
  chooses once, at the first round (copied then), and the last `window_length` verified positions after the prompt.

The target still verifies every token with full attention, so the output is unchanged.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from transformers.generation.candidate_generator import SinglePositionMultiTokenCandidateGenerator

from ..cache.selection import BudgetSelection
from ..cache.sizes import check_size
from .cache_config import WindowedSpec
from .spec import cache_defaults

# the class-name prefixes transformers' own generate() reads as shared-KV assistants
SHARED_KV_ASSISTANTS = ("Gemma4Assistant", "Gemma4UnifiedAssistant")


def is_shared_kv_assistant(model) -> bool:
    """Whether `model` drafts from the target's `shared_kv_states` (as transformers decides it)."""
    return model is not None and type(model).__name__.startswith(SHARED_KV_ASSISTANTS)


class SinkWindowRead:
    """The first `num_sink_tokens` and the last `window_length` of the verified positions (views)."""

    def __init__(self, num_sink_tokens: int, window_length: int):
        check_size("num_sink_tokens", num_sink_tokens, 0)
        check_size("window_length", window_length, 1)
        self.num_sink_tokens, self.window_length = num_sink_tokens, window_length

    def __call__(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> tuple[torch.Tensor, ...]:
        """`keys`, `values` `(B, H, L', D)` cut to the sink + window of their first `length` positions (as given
        where those fit)."""
        if length <= self.num_sink_tokens + self.window_length:
            return keys, values
        return tuple(
            torch.cat(
                [states[:, :, : self.num_sink_tokens], states[:, :, length - self.window_length : length]], 2
            )
            for states in (keys, values)
        )


class BudgetRead:
    """Per KV head, `budget` prompt positions chosen by `policy` at the first call (the prompt's states), then the
    last `window_length` verified positions after the prompt. One read per call of `generate()` (it keeps the
    choice). Policies that read queries (`snapkv`, `dynamic`, `chunk` with `query_proxy="last_query"`) are refused:
    the target hands its assistant keys and values only."""

    def __init__(self, budget: int, policy, window_length: int, policy_kwargs: dict | None = None):
        self.selection = BudgetSelection(budget, policy, policy_kwargs)
        if self.selection.uses_queries or self.selection.refreshes:
            raise ValueError(
                f"policy={self.selection.policy.name!r} selects with queries, but a Gemma 4 assistant is handed the "
                "target's keys and values only; use policy='chunk' (query_proxy='last_key') or 'streaming'"
            )
        check_size("window_length", window_length, 1)
        self.window_length = window_length
        self.prompt = None  # (prompt length, kept keys (B, H, n, D), kept values (B, H, n, D))

    def __call__(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> tuple[torch.Tensor, ...]:
        """The kept prompt positions, then the positions of `[prompt, length)` within the window."""
        if self.prompt is None:
            _, kept_keys, kept_values = self.selection.keep(keys[:, :, :length], values[:, :, :length])
            self.prompt = (min(length, keys.shape[2]), kept_keys, kept_values)
        prompt, kept_keys, kept_values = self.prompt
        start = max(prompt, length - self.window_length)
        return torch.cat([kept_keys, keys[:, :, start:length]], 2), torch.cat(
            [kept_values, values[:, :, start:length]], 2
        )


READS = {
    "sink_window": (SinkWindowRead, cache_defaults("sink_window", ("num_sink_tokens", "window_length"))),
    "budgeted": (
        BudgetRead,
        cache_defaults("budgeted", ("budget", "policy", "window_length", "policy_kwargs")),
    ),
}


def read_states(
    states: dict[str, tuple[torch.Tensor, torch.Tensor]], length: int, read
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """`states` (`(B, H, L', D)` keys and values per layer type) with the full-attention ones `read` over their first
    `length` positions, the verified ones (`L' < length` after the prefill, whose states end before the first token);
    the others as given."""
    keys, values = states["full_attention"]
    return {**states, "full_attention": read(keys, values, min(length, keys.shape[2]))}


class WindowedAssistantCandidateGenerator(SinglePositionMultiTokenCandidateGenerator):
    """transformers' shared-KV assistant generator, its full-attention states cut each round by `read`.

    Args:
        read (`SinkWindowRead` or `BudgetRead`): what the assistant reads of the target's full-attention states.
    """

    def __init__(self, *args, read, **kwargs):
        super().__init__(*args, **kwargs)
        self.read = read

    @classmethod
    def for_call(cls, target, assistant_model, generation_config) -> WindowedAssistantCandidateGenerator:
        """The generator of a `generate(..., assistant_model=assistant, cache_implementation=...)` call
        (`"sink_window"` or `"budgeted"`)."""
        name = generation_config.cache_implementation
        spec = WindowedSpec.from_cache_config(f"assistant_{name}", generation_config.cache_config)
        read_class, defaults = READS[name]
        return cls(
            assistant_model=assistant_model,
            target_model_input_embeddings=target.get_input_embeddings(),
            generation_config=generation_config,
            read=read_class(**{**defaults, **spec.cache_options}),
        )

    def get_candidates(
        self, input_ids, model_kwargs, model_outputs, is_first_iteration, n_last_matches, **kwargs
    ):
        states = getattr(model_outputs, "shared_kv_states", None)
        if states is not None and "full_attention" in states:
            model_outputs = SimpleNamespace(
                hidden_states=model_outputs.hidden_states,
                shared_kv_states=read_states(states, input_ids.shape[1], self.read),
            )
        return super().get_candidates(
            input_ids, model_kwargs, model_outputs, is_first_iteration, n_last_matches, **kwargs
        )
