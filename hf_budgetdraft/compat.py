"""What differs between the transformers releases this package supports, decided from what the installed one has.

The integration hooks private steps of `generate()` that move between minor releases. Every difference is settled
here, from the installed transformers' own signatures and attributes (never from its version string alone):

- `CACHE_KWARG`: the name of the KV cache argument of a model's forward, of `generate()` and of `model_kwargs`:
  `cache` from 5.24 on, `past_key_values` before (5.24 still takes the old name, with a deprecation warning);
- `activate_past_recording`: let a draft cache roll back its bounded layers; from 5.25 a recurrent layer can also
  record its intermediate states, which a drafter's sparse cache asks for (before 5.25 recurrent drafters are
  refused at the first rollback);
- `prepare_draft_inputs`: the assistant's attention mask / position ids / token type ids for a round (the helpers
  `AssistedCandidateGenerator._update_past_and_masks` calls, whose own signature changed in 5.25);
- `patch_point_problems()`: what the package relies on that the installed transformers lacks. `install()` refuses
  speculative calls on sparse draft caches when it finds any (`integration._refusing_generate`); plain `generate()` calls
  are untouched either way.

`TESTED` is the range CI runs: the full suite on its newest release, the integration-critical tests on its oldest
(`scripts/check_release.sh transformers VERSION` runs those on any release).
"""

from __future__ import annotations

import inspect

import transformers
from transformers import cache_utils, masking_utils
from transformers.generation import candidate_generator as stock
from transformers.generation.utils import GenerationMixin

TESTED = ("5.22", "5.25")  # oldest and newest tested minor releases (pyproject.toml pins the same range)
CACHE_KWARG = (
    "cache"
    if "cache" in inspect.signature(masking_utils.create_causal_mask).parameters
    else "past_key_values"
)
_RECURRENT_STATES_TO_KEEP = (
    "recurrent_states_to_keep"
    in inspect.signature(cache_utils.LinearAttentionCacheLayerMixin.activate_past_recording).parameters
)

# the generate() steps the integration wraps, and the parameters it reads or passes by name
_GENERATION_STEPS = {
    "_maybe_prepare_encoder_kwargs_for_generation": (
        "inputs_tensor",
        "model_kwargs",
        "model_input_name",
        "generation_config",
    ),
    "_assisted_decoding": ("input_ids", "generation_config", "assistant_model"),
    "_get_candidate_generator": (
        "generation_config",
        "input_ids",
        "inputs_tensor",
        "logits_processor",
        "model_kwargs",
        "assistant_model",
        "target_tokenizer",
        "assistant_tokenizer",
    ),
    "_prepare_cache_for_generation": (
        "generation_config",
        "model_kwargs",
        "generation_mode",
        "batch_size",
        "max_cache_length",
    ),
    "_sample": ("input_ids", "generation_config"),
    "prepare_inputs_for_generation": ("input_ids", "next_sequence_length", "is_first_iteration"),
    "_validate_generation_mode": ("generation_mode", "generation_config", "generation_mode_kwargs"),
}
_CANDIDATE_GENERATOR_STEPS = (
    "get_candidates",
    "_update_past_and_masks",
    "_generate_candidates",
    "_calculate_new_tokens",
)
_DRAFT_INPUT_HELPERS = ("_prepare_attention_mask", "_prepare_position_ids", "_prepare_token_type_ids")


def cache_kwargs(cache) -> dict:
    """`{CACHE_KWARG: cache}`: pass a cache to a model's forward or to `generate()` on any supported release."""
    return {CACHE_KWARG: cache}


def output_cache(output):
    """The cache a model output or a `generate()` output carries (`None` if none)."""
    return getattr(output, CACHE_KWARG, None)


def activate_past_recording(cache, recurrent_states_to_keep: int = 0) -> None:
    """Make `cache`'s bounded layers (sliding windows, convolution states) keep what `crop(-n)` needs to roll back,
    and from 5.25 its recurrent layers the states of their last `recurrent_states_to_keep` tokens (before 5.25 they
    keep none, and a recurrent layer cannot be rolled back)."""
    if _RECURRENT_STATES_TO_KEEP:
        cache.activate_past_recording(recurrent_states_to_keep=recurrent_states_to_keep)
    else:
        cache.activate_past_recording()


def prepare_draft_inputs(assistant_kwargs: dict, length: int, is_encoder_decoder: bool) -> dict:
    """The assistant's `attention_mask`, `position_ids` and `token_type_ids` extended to `length` tokens, as
    `AssistedCandidateGenerator._update_past_and_masks` does after rolling its cache back."""
    assistant_kwargs = stock._prepare_attention_mask(assistant_kwargs, length, is_encoder_decoder)
    assistant_kwargs = stock._prepare_position_ids(assistant_kwargs, length, is_encoder_decoder)
    return stock._prepare_token_type_ids(assistant_kwargs, length)


def patch_point_problems() -> list[str]:
    """What the integration relies on that the installed transformers does not have (empty: all there)."""
    problems = []
    for name, wanted in _GENERATION_STEPS.items():
        step = getattr(GenerationMixin, name, None)
        if step is None:
            problems.append(f"GenerationMixin.{name} is gone")
            continue
        parameters = inspect.signature(step).parameters
        missing = [p for p in wanted if p not in parameters]
        if missing:
            problems.append(f"GenerationMixin.{name} no longer takes {missing}")
    problems += [
        f"AssistedCandidateGenerator.{name} is gone"
        for name in _CANDIDATE_GENERATOR_STEPS
        if not hasattr(stock.AssistedCandidateGenerator, name)
    ]
    problems += [
        f"candidate_generator.{name} is gone" for name in _DRAFT_INPUT_HELPERS if not hasattr(stock, name)
    ]
    config_property = vars(transformers.PreTrainedConfig).get("_attn_implementation")
    if not isinstance(config_property, property):
        problems.append("PreTrainedConfig._attn_implementation is no longer a property")
    return problems


def installed_is_tested() -> bool:
    """Whether the installed transformers' minor release lies in `TESTED`."""
    minor = tuple(int(part) for part in transformers.__version__.split(".")[:2])
    low, high = (tuple(int(part) for part in bound.split(".")) for bound in TESTED)
    return low <= minor <= high


def refusal(problems: list[str]) -> str:
    """The message a speculative call gets when `problems` keep the integration from this transformers."""
    return (
        f"hf-budgetdraft cannot speculate on transformers {transformers.__version__} (tested: {TESTED[0]} to "
        f"{TESTED[1]}): {'; '.join(problems)}. Install a tested release (pip install 'transformers>={TESTED[0]},"
        f"<{_next_minor(TESTED[1])}') or an hf-budgetdraft that supports this one. Plain generate() calls are "
        "unaffected."
    )


def _next_minor(version: str) -> str:
    major, minor = version.split(".")
    return f"{major}.{int(minor) + 1}"
