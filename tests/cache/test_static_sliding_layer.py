"""A drafter's own sliding layers on a static draft cache: fixed-shape rings that read what transformers' sliding
layers read, step by step and block by block, and roll back exactly."""

import pytest
import torch
from tiny_families import family_pair, kv_sharing_model
from tiny_models import COMMON, random_prompt, skip_unless_static
from transformers import AutoConfig, DynamicCache
from transformers.cache_utils import DynamicSlidingWindowLayer

from hf_budgetdraft import BudgetedCache, SinkWindowCache
from hf_budgetdraft.attention.varlen import NAME as VARLEN
from hf_budgetdraft.cache import StaticDraftLayer, StaticSlidingLayer, has_fixed_shape_steps
from hf_budgetdraft.cache.static_sliding_layer import LARGEST_RING
from hf_budgetdraft.compat import cache_kwargs

SLIDING_WINDOW = 24  # the tiny families' own


def _feed(model, cache, tokens: torch.Tensor, start: int) -> torch.Tensor:
    """One forward of `tokens` `(1, n)` at positions `start..`: its logits `(n, V)`."""
    position = torch.arange(start, start + tokens.shape[1])[None]
    return model(tokens, **cache_kwargs(cache), position_ids=position, use_cache=True).logits[0]


@pytest.mark.parametrize("family", ["gemma3", "cohere2"])
@torch.no_grad()
def test_sliding_layers_read_what_the_models_own_cache_reads_and_roll_back_exactly(family):
    """A covering draft window keeps every key of the full layers, so every logit must be the model's own: steps of
    one token and of a block (each query's window ends at that query), after drafts rolled back past the ring."""
    model, _ = family_pair(family)
    skip_unless_static(model)
    reference = DynamicCache(config=model.config)
    model.set_attn_implementation(VARLEN)
    cache = SinkWindowCache(model.config, num_sink_tokens=4, window_length=1024, slack=8, static=True)
    cache.activate_past_recording()
    assert [type(layer) for layer in cache.layers] == [StaticSlidingLayer, StaticDraftLayer]
    assert cache.is_sliding == [True, False] and not cache.can_skip()
    prompt = random_prompt(80)
    torch.testing.assert_close(_feed(model, cache, prompt, 0), _ref(model, reference, prompt, 0))
    start = 80
    for block, drafts in [(1, 3), (3, 5), (2, 8), (1, 0), (4, 2)]:
        tokens = random_prompt(block, seed=start)
        torch.testing.assert_close(_feed(model, cache, tokens, start), _ref(model, reference, tokens, start))
        start += block
        for i in range(drafts):  # drafted one at a time, then rejected
            _feed(model, cache, random_prompt(1, seed=1000 + i), start + i)
        cache.crop(-drafts)
    assert cache.get_seq_length() == start
    assert (
        cache.layers[0].keys.shape[2] == SLIDING_WINDOW - 1 + 8
    )  # its window and the slack, whatever the length


def _ref(model, cache, tokens, start):
    """The model's own logits on transformers' cache (its sliding layer keeps `sliding_window - 1` keys)."""
    model.set_attn_implementation("sdpa")
    try:
        return _feed(model, cache, tokens, start)
    finally:
        model.set_attn_implementation(VARLEN)


def test_a_wrong_sliding_window_is_refused():
    with pytest.raises(ValueError, match="sliding_window, an int >= 2, got None"):
        StaticSlidingLayer(None, slack=8)


def test_only_the_static_storage_replaces_transformers_sliding_layers():
    model, _ = family_pair("gemma3")
    dynamic = BudgetedCache(model.config, budget=32, window_length=16)
    assert type(dynamic.layers[0]) is DynamicSlidingWindowLayer
    model.set_attn_implementation(VARLEN)
    static = BudgetedCache(model.config, budget=32, window_length=16, static=True)
    assert type(static.layers[0]) is StaticSlidingLayer and static.layers[0].sliding_window == SLIDING_WINDOW


@pytest.mark.parametrize(
    ("family", "fixed"),
    [("gemma3", True), ("mistral-all-sliding", True), ("lfm2", False), ("inkling", False)],
)
def test_fixed_shape_steps_are_full_attention_and_sliding_layers_only(family, fixed):
    model, _ = family_pair(family)
    assert has_fixed_shape_steps(model.config) is fixed


def test_layers_reusing_earlier_keys_hold_nothing_and_keep_the_steps_fixed():
    """Gemma 4 past its KV-sharing point: transformers 5.25 gives those layers a `dummy` cache layer."""
    assert has_fixed_shape_steps(kv_sharing_model().config)


@pytest.mark.parametrize("sliding_window", [24, LARGEST_RING + 1])
def test_a_window_too_large_for_a_ring_keeps_transformers_growing_layer(sliding_window):
    """A ring is allocated whole: a window of hundreds of thousands (Phi-3's 128K models) would allocate it for any
    prompt. Such a layer keeps transformers' layer, which grows with the context, and the step is not compiled."""
    config = AutoConfig.for_model("mistral", **COMMON, sliding_window=sliding_window)
    config._attn_implementation = VARLEN
    cache = SinkWindowCache(config, num_sink_tokens=4, window_length=16, static=True)
    ring = sliding_window <= LARGEST_RING
    expected = StaticSlidingLayer if ring else DynamicSlidingWindowLayer
    assert all(type(layer) is expected for layer in cache.layers)
    assert has_fixed_shape_steps(config) is ring
