"""`hf_budgetdraft.uninstall()` puts back every callable the package patched — transformers' `generate()` steps and
its list of cache names, the config's attention property, `nn.Linear.forward` — and `install()` works again after."""

import pytest
import torch
from tiny_models import model_pair, random_prompt
from torch import nn
from transformers import PreTrainedConfig
from transformers.generation import configuration_utils
from transformers.generation.utils import GenerationMixin

import hf_budgetdraft

STEPS = ("_assisted_decoding", "_get_candidate_generator", "_prepare_cache_for_generation", "_sample")


def patched() -> dict:
    """What is the package's now, by where each callable comes from."""
    prop = PreTrainedConfig.__dict__["_attn_implementation"]
    return {
        **{name: getattr(GenerationMixin, name).__module__.startswith("hf_budgetdraft") for name in STEPS},
        "cache names": "budgeted" in configuration_utils.ALL_CACHE_IMPLEMENTATIONS,
        "attention property": prop.fget.__module__.startswith("hf_budgetdraft"),
        "nn.Linear.forward": nn.Linear.forward.__module__.startswith("hf_budgetdraft"),
    }


def test_uninstall_restores_every_patch_and_install_comes_back():
    target, drafter = model_pair(
        "llama", "sdpa", num_assistant_tokens=None
    )  # float32 on CPU: few-row linears
    ids = random_prompt(100, seed=1)
    expected = target.generate(ids, do_sample=False, max_new_tokens=20)
    kwargs = dict(
        assistant_model=drafter, do_sample=False, max_new_tokens=20, cache_implementation="budgeted"
    )
    assert torch.equal(target.generate(ids, **kwargs), expected)  # installs the lazy patches too
    assert all(patched().values()), patched()
    try:
        hf_budgetdraft.uninstall()
        assert not any(patched().values()), patched()
        with pytest.raises(ValueError, match="budgeted"):  # transformers' own check refuses the name again
            target.generate(ids, **kwargs)
        assert torch.equal(target.generate(ids, do_sample=False, max_new_tokens=20), expected)
        hf_budgetdraft.uninstall()  # twice: nothing left to undo
    finally:
        hf_budgetdraft.install()
    assert torch.equal(target.generate(ids, **kwargs), expected)
    assert all(patched().values()), patched()
