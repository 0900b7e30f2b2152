"""`timed_generate`'s result keeps what ran (`stats.runtime`) after the call drops its generator and draft cache."""

import pytest
import torch
from tiny_models import model_pair, random_prompt

from hf_budgetdraft.eval.runners import run_ar, run_assisted

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("device_round", [False, True], ids=["transformers_loop", "device_round"])
def test_a_timed_call_keeps_what_ran(device_round):
    target, drafter = model_pair("llama", "sdpa", num_assistant_tokens=None)
    ids = random_prompt(40)
    config = {"device_round": device_round, "compile_verify": False}
    result = run_assisted(target, drafter, ids, 8, None, "budgeted", config)
    expected = run_ar(target, ids, 8)
    assert torch.equal(result.new_ids, expected.new_ids)
    assert result.stats.candidate_generator is None  # the draft cache is not held after the call
    assert result.runtime["loop"] == ("device_round" if device_round else "transformers")
    if device_round:
        assert (
            result.runtime["verify"]["compiled"] is False and result.runtime["verify"]["graphs_compiled"] == 0
        )
    assert expected.runtime is None  # plain AR has no sparse-draft generator
