"""Windowed shared-KV assistants: a Gemma 4 assistant reads an attention sink + a recent window of the target's
full-attention keys/values.

transformers drafts with a Gemma 4 assistant (`Gemma4AssistantForCausalLM`, or the unified one) through
`SinglePositionMultiTokenCandidateGenerator`: it has no cache of its own; each draft step's queries attend to the
target's `shared_kv_states`, the keys/values of the target's last sliding and last full-attention layer over the
whole context. The sliding ones are bounded by the target's window; the full-attention ones grow with the context,
the draft-KV tax Windowed-MTP (arXiv 2607.21535) removes. Here, before each round, the full-attention states are cut
to their first `num_sink_tokens` positions and their last `window_length` verified ones (views: nothing is copied or
kept between rounds). The target still verifies every token with full attention, so the output is unchanged.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import torch
from transformers.generation.candidate_generator import SinglePositionMultiTokenCandidateGenerator

from ..cache.draft_cache import SinkWindowCache
from ..cache.sizes import check_size
from .cache_config import WindowedSpec

# the class-name prefixes transformers' own generate() reads as shared-KV assistants
SHARED_KV_ASSISTANTS = ("Gemma4Assistant", "Gemma4UnifiedAssistant")
_DEFAULTS = {
    name: parameter.default
    for name, parameter in inspect.signature(SinkWindowCache.__init__).parameters.items()
    if name in ("num_sink_tokens", "window_length")
}


def is_shared_kv_assistant(model) -> bool:
    """Whether `model` drafts from the target's `shared_kv_states` (as transformers decides it)."""
    return model is not None and type(model).__name__.startswith(SHARED_KV_ASSISTANTS)


def window_states(
    states: dict[str, tuple[torch.Tensor, torch.Tensor]],
    length: int,
    num_sink_tokens: int,
    window_length: int,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """`states` (`(B, H, L', D)` keys and values per layer type) with the full-attention ones cut to the sink +
    window of their first `length` positions, the verified ones (`L' < length` after the prefill, whose states end
    before the first token); the others as given."""
    windowed = dict(states)
    keys, values = states["full_attention"]
    length = min(length, keys.shape[2])
    if length > num_sink_tokens + window_length:
        windowed["full_attention"] = tuple(
            torch.cat([states[:, :, :num_sink_tokens], states[:, :, length - window_length : length]], dim=2)
            for states in (keys, values)
        )
    return windowed


class WindowedAssistantCandidateGenerator(SinglePositionMultiTokenCandidateGenerator):
    """transformers' shared-KV assistant generator, its full-attention states cut to a sink + window each round.

    Args:
        num_sink_tokens (`int`): the first positions always read.
        window_length (`int`): the most recent verified positions read.
    """

    def __init__(self, *args, num_sink_tokens: int, window_length: int, **kwargs):
        check_size("num_sink_tokens", num_sink_tokens, 0)
        check_size("window_length", window_length, 1)
        super().__init__(*args, **kwargs)
        self.num_sink_tokens, self.window_length = num_sink_tokens, window_length

    @classmethod
    def for_call(cls, target, assistant_model, generation_config) -> WindowedAssistantCandidateGenerator:
        """The generator of a `generate(..., assistant_model=assistant, cache_implementation="sink_window")` call."""
        spec = WindowedSpec.from_cache_config("assistant", generation_config.cache_config)
        sizes = {**_DEFAULTS, **spec.cache_options}
        return cls(
            assistant_model=assistant_model,
            target_model_input_embeddings=target.get_input_embeddings(),
            generation_config=generation_config,
            **sizes,
        )

    def get_candidates(
        self, input_ids, model_kwargs, model_outputs, is_first_iteration, n_last_matches, **kwargs
    ):
        states = getattr(model_outputs, "shared_kv_states", None)
        if states is not None and "full_attention" in states:
            window = window_states(states, input_ids.shape[1], self.num_sink_tokens, self.window_length)
            model_outputs = SimpleNamespace(
                hidden_states=model_outputs.hidden_states, shared_kv_states=window
            )
        return super().get_candidates(
            input_ids, model_kwargs, model_outputs, is_first_iteration, n_last_matches, **kwargs
        )
