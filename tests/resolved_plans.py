"""The plan `generate()` would resolve for a call, without generating: for tests of the plan's choices."""

import contextlib

import pytest
import torch
from transformers import GenerationConfig

import hf_budgetdraft.generation.plan as plan_module
from hf_budgetdraft import DraftSpec
from hf_budgetdraft.generation.device_rules import device_rules
from hf_budgetdraft.generation.plan import resolve_plan


def plan_for(target, drafter, name="budgeted", cache_config=None, **call):
    """The `DraftPlan` of `target.generate(..., assistant_model=drafter, cache_implementation=name,
    cache_config=cache_config, **call)`."""
    config = GenerationConfig(**call)
    config.update(**config._get_default_generation_params(), defaults_only=True)  # as generate() fills it
    return resolve_plan(
        DraftSpec.from_cache_config(name, cache_config), cache_config, target, drafter, config
    )


@contextlib.contextmanager
def cuda_rules_on_cpu():
    """Inside the block, plans for models on the CPU follow CUDA's device rules (the device round, compiling from
    the first call): the GPU's choices, run on the CPU."""
    cuda = device_rules("cuda")

    def rules(device, dtype=torch.float32):
        return cuda if torch.device(device).type == "cpu" else device_rules(device, dtype)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(plan_module, "device_rules", rules)
        yield
