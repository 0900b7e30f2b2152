"""The draft caches as a user builds them: bad parameters refused with what to change, memory bounded whatever the
context, and a target run alone on one is bounded and, past its window, lossy."""

import pytest
import torch
from tiny_models import model_pair, random_prompt, tiny_config
from transformers import DynamicCache

from hf_budgetdraft import BudgetedCache, SinkWindowCache, cache_nbytes


@pytest.mark.parametrize(
    "make,error,match",
    [
        (lambda c: SinkWindowCache(c, window_length=0), ValueError, "window_length must be in"),
        (lambda c: SinkWindowCache(c, num_sink_tokens=-1), ValueError, "num_sink_tokens must be in"),
        (lambda c: SinkWindowCache(c, window_length=1 << 30), ValueError, "window_length must be in"),
        (lambda c: SinkWindowCache(c, slack=0), ValueError, "slack must be in"),
        (lambda c: SinkWindowCache(c, window_length=8.5), TypeError, "window_length must be an int"),
        (lambda c: BudgetedCache(c, budget=10, policy="chunk"), ValueError, "budget=10 is too small"),
        (lambda c: BudgetedCache(c, budget=64, policy="h2o"), ValueError, "unknown policy='h2o'"),
        (lambda c: SinkWindowCache(None), TypeError, "config must be the model's PreTrainedConfig"),
    ],
)
def test_bad_cache_parameters(make, error, match):
    with pytest.raises(error, match=match):
        make(tiny_config("llama"))


def test_target_alone_on_a_sparse_cache_is_lossy_but_bounded():
    """Without a drafter the sparse cache is the target's own cache: its memory does not grow with the prompt,
    and once the prompt is past the window the target forgets context, so its greedy output changes."""
    target, _ = model_pair("llama")
    window = 16
    sparse = dict(
        cache_implementation="sink_window", cache_config={"num_sink_tokens": 4, "window_length": window}
    )
    sizes = []
    for length in (window, 4 * window):
        ids = random_prompt(length)
        out = target.generate(ids, do_sample=False, max_new_tokens=8, return_dict_in_generate=True, **sparse)
        assert out.sequences.shape[1] == length + 8
        assert isinstance(out.cache, SinkWindowCache)
        sizes.append(cache_nbytes(out.cache))
    assert sizes[0] == sizes[1] == out.cache.nbytes() > 0
    full = target.generate(ids, do_sample=False, max_new_tokens=8, return_dict_in_generate=True)
    assert cache_nbytes(full.cache) > sizes[1]
    # the tiny random model's next token depends on tokens the window has dropped
    assert not torch.equal(out.sequences, full.sequences)


@pytest.mark.parametrize(
    "make",
    [
        lambda c: SinkWindowCache(c, num_sink_tokens=16, window_length=128),
        lambda c: BudgetedCache(c, budget=128, policy="chunk"),
        lambda c: BudgetedCache(c, budget=128, policy="streaming", window_length=64),
    ],
)
def test_memory_is_independent_of_context_length(make):
    target, _ = model_pair("llama")
    sizes = []
    for context in (1024, 8192):
        cache = make(target.config)
        with torch.no_grad():
            target(random_prompt(context), cache=cache)
            for token in range(5):
                target(torch.tensor([[token]]), cache=cache)
        sizes.append(cache.nbytes())
    full = DynamicCache(config=target.config)
    with torch.no_grad():
        target(random_prompt(1024), cache=full)
    assert sizes[0] == sizes[1]
    assert sizes[0] < cache_nbytes(full)
