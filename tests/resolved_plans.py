"""The plan `generate()` would resolve for a call, without generating: for tests of the plan's choices."""

from transformers import GenerationConfig

from hf_budgetdraft import DraftSpec
from hf_budgetdraft.generation.plan import resolve_plan


def plan_for(target, drafter, name="budgeted", cache_config=None, **call):
    """The `DraftPlan` of `target.generate(..., assistant_model=drafter, cache_implementation=name,
    cache_config=cache_config, **call)`."""
    config = GenerationConfig(**call)
    config.update(**config._get_default_generation_params(), defaults_only=True)  # as generate() fills it
    return resolve_plan(
        DraftSpec.from_cache_config(name, cache_config), cache_config, target, drafter, config
    )
