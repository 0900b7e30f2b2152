"""`GrowableCache`: the transformers Cache layer contract against a `DynamicLayer` oracle (hypothesis sequences of
update/crop/reset), appends in place (no copy of the past), exact crop, plain AR use with `cache=`, and automatic use
for the target when speculating with this package's draft caches."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import model_pair, random_prompt, tiny_config
from transformers import AutoConfig, DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionLayer

import hf_budgetdraft
from hf_budgetdraft import GrowableCache, cache_nbytes
from hf_budgetdraft.cache import GrowableLayer

HEADS, DIM = 2, 4

operations = st.lists(
    st.one_of(
        st.tuples(st.just("update"), st.integers(1, 9)),
        st.tuples(st.just("crop"), st.integers(0, 12)),
        st.tuples(st.just("reset"), st.just(0)),
    ),
    max_size=30,
)


def _kv(n, generator, batch=1):
    return (
        torch.randn(batch, HEADS, n, DIM, generator=generator),
        torch.randn(batch, HEADS, n, DIM + 1, generator=generator),  # values may have another head dim
    )


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    initial_capacity=st.integers(1, 8),
    growth_factor=st.sampled_from([1.25, 2.0, 3.0]),
    ops=operations,
    seed=st.integers(0, 2**16),
)
def test_layer_matches_dynamic_layer_oracle(initial_capacity, growth_factor, ops, seed):
    generator = torch.Generator().manual_seed(seed)
    layer, oracle = GrowableLayer(initial_capacity, growth_factor), DynamicLayer()
    for kind, n in ops:
        length = layer.get_seq_length()
        if kind == "update":
            keys, values = _kv(n, generator)
            kv_length, kv_offset = layer.get_mask_sizes(n)
            assert (kv_length, kv_offset) == oracle.get_mask_sizes(n) == (length + n, 0)
            out_keys, out_values = layer.update(keys, values)
            expected_keys, expected_values = oracle.update(keys, values)
            assert torch.equal(out_keys, expected_keys) and torch.equal(out_values, expected_values)
            assert out_keys.shape[-2] == kv_length, "get_mask_sizes disagrees with the keys returned"
            assert out_keys.data_ptr() == layer.key_buffer.data_ptr()  # a view of the buffer, not a copy
        elif kind == "crop":
            if n > length and layer.is_initialized:  # (an unused layer ignores crops, like DynamicLayer)
                with pytest.raises(ValueError, match="removes more than"):
                    layer.crop(-n)
                continue
            layer.crop(-n)
            oracle.crop(-n)
        else:
            layer.reset()
            oracle.reset()
        assert layer.get_seq_length() == oracle.get_seq_length()
        if layer.is_initialized and oracle.is_initialized and oracle.get_seq_length():
            assert torch.equal(layer.keys, oracle.keys) and torch.equal(layer.values, oracle.values)
        assert layer.capacity >= layer.get_seq_length()


def test_appends_in_place_and_grows_geometrically():
    generator = torch.Generator().manual_seed(0)
    layer = GrowableLayer(initial_capacity=16, growth_factor=2.0)
    layer.update(*_kv(10, generator))
    capacities = [layer.capacity]
    for _ in range(1000):
        buffer, capacity = layer.key_buffer, layer.capacity
        layer.update(*_kv(1, generator))
        if layer.capacity == capacity:
            # in place: the very same buffer (held here, so its address cannot be recycled by the allocator)
            assert layer.key_buffer is buffer and layer.key_buffer.data_ptr() == buffer.data_ptr()
        else:
            capacities.append(layer.capacity)
    assert layer.get_seq_length() == 1010
    assert capacities == [16, 32, 64, 128, 256, 512, 1024]  # 6 growths for 1000 one-token appends
    buffer = layer.key_buffer
    layer.crop(-5)
    layer.update(*_kv(5, generator))
    assert layer.key_buffer is buffer  # rollback + re-append reuses the buffer


def test_gradients_flow_through_new_keys():
    layer, oracle = GrowableLayer(4), DynamicLayer()
    generator = torch.Generator().manual_seed(0)
    past = _kv(6, generator)
    layer.update(*past)
    oracle.update(*past)
    new = [t.requires_grad_() for t in _kv(3, generator)]
    keys, values = layer.update(*new)
    (keys.square().sum() + values.sum()).backward()
    grads = [t.grad.clone() for t in new]
    new2 = [t.detach().requires_grad_() for t in new]
    keys, values = oracle.update(*new2)
    (keys.square().sum() + values.sum()).backward()
    for got, expected in zip(grads, [t.grad for t in new2], strict=True):
        torch.testing.assert_close(got, expected)


def test_beam_search_reorders_buffers():
    target, _ = model_pair("llama", "sdpa")
    ids = random_prompt(40)
    expected = target.generate(ids, do_sample=False, max_new_tokens=12, num_beams=3)
    out = target.generate(
        ids,
        do_sample=False,
        max_new_tokens=12,
        num_beams=3,
        cache=GrowableCache(config=target.config, initial_capacity=8),
    )
    assert torch.equal(out, expected)


@pytest.mark.parametrize("family", ["llama", "gpt_neox", "qwen3"])
@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_plain_ar_forward_and_generate(family, attn_implementation):
    target, _ = model_pair(family, attn_implementation)
    ids = random_prompt(100)
    with torch.no_grad():
        caches = [
            DynamicCache(config=target.config),
            GrowableCache(config=target.config, initial_capacity=32),
        ]
        logits = [
            [
                target(ids[:, :90], cache=c).logits,
                *(target(ids[:, i : i + 1], cache=c).logits for i in range(90, 100)),
            ]
            for c in caches
        ]
    for expected, got in zip(*logits, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    expected = target.generate(ids, do_sample=False, max_new_tokens=24)
    assert torch.equal(
        target.generate(ids, do_sample=False, max_new_tokens=24, cache=GrowableCache(target.config)), expected
    )


def test_layer_types_follow_the_config():
    assert all(isinstance(layer, GrowableLayer) for layer in GrowableCache(tiny_config("llama")).layers)
    gemma2 = GrowableCache(tiny_config("gemma2", num_layers=4))  # alternating sliding / full
    assert [type(layer) for layer in gemma2.layers] == [DynamicSlidingWindowLayer, GrowableLayer] * 2
    hybrid = GrowableCache(AutoConfig.for_model("qwen3_next", num_hidden_layers=4))
    assert any(isinstance(layer, LinearAttentionLayer) for layer in hybrid.layers)
    assert any(isinstance(layer, GrowableLayer) for layer in hybrid.layers)
    lazy = GrowableCache(initial_capacity=4)  # no config: one GrowableLayer per layer, created on first use
    lazy.update(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4), layer_idx=1)
    assert len(lazy.layers) == 2 and all(isinstance(layer, GrowableLayer) for layer in lazy.layers)
    assert lazy.layers[1].capacity == 4 and lazy.get_seq_length(1) == 3


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"initial_capacity": 0}, ValueError, "initial_capacity must be in"),
        ({"initial_capacity": 2.5}, TypeError, "initial_capacity must be an int"),
        ({"growth_factor": 1.0}, ValueError, "growth_factor must be a number in"),
        ({"growth_factor": "2"}, ValueError, "growth_factor must be a number in"),
        ({"config": {"model_type": "llama"}}, TypeError, "config must be the model's PreTrainedConfig"),
    ],
)
def test_bad_parameters(kwargs, error, match):
    with pytest.raises(error, match=match):
        GrowableCache(**kwargs)


def test_bad_crop_and_mismatched_update():
    layer = GrowableLayer(4)
    layer.update(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4))
    with pytest.raises(ValueError, match="negative count"):
        layer.crop(2)
    with pytest.raises(ValueError, match="the most is crop"):
        layer.crop(-4)
    with pytest.raises(ValueError, match="create a new GrowableCache"):
        layer.update(torch.zeros(2, 2, 1, 4), torch.zeros(2, 2, 1, 4))
    assert layer.get_seq_length() == 3


def test_nbytes_counts_the_allocated_buffers():
    cache = GrowableCache(tiny_config("llama"), initial_capacity=64)
    cache.update(torch.zeros(1, 2, 5, 16), torch.zeros(1, 2, 5, 16), layer_idx=0)
    assert cache_nbytes(cache) == cache.nbytes() == 2 * 2 * 64 * 16 * 4


def test_target_cache_when_speculating():
    """Full-attention targets get a GrowableCache sized for the call; others keep transformers' default."""
    target, drafter = model_pair("llama", "sdpa")
    ids = random_prompt(60)
    kwargs = dict(
        assistant_model=drafter,
        do_sample=False,
        max_new_tokens=10,
        cache_implementation="sink_window",
        cache_config={"num_sink_tokens": 4, "window_length": 16},
        return_dict_in_generate=True,
    )
    out = target.generate(ids, **kwargs)
    assert isinstance(out.cache, GrowableCache)
    assert out.cache.layers[0].capacity == ids.shape[1] + 10 - 1  # no growth during the call
    # a hybrid sliding/full target (gemma2) keeps transformers' DynamicCache
    hybrid_target, hybrid_drafter = model_pair("gemma2", "eager")
    out = hybrid_target.generate(ids, **{**kwargs, "assistant_model": hybrid_drafter})
    assert type(out.cache) is DynamicCache
    # plain AR and stock assisted generation are untouched
    assert type(target.generate(ids, max_new_tokens=2, return_dict_in_generate=True).cache) is DynamicCache
    given = DynamicCache(
        config=target.config
    )  # a cache the caller passes is kept (tests/generation/test_prefilled.py)
    assert target.generate(ids, **{**kwargs, "cache": given}).cache is given
    assert hf_budgetdraft.GrowableCache is GrowableCache and "GrowableCache" in hf_budgetdraft.__all__


def test_a_cache_filled_under_inference_mode_takes_appends_outside_it():
    """A prefix prefilled under `torch.inference_mode()`, then continued by `generate()` (which runs under
    `no_grad`): the buffers become ordinary tensors once, as transformers' `DynamicLayer` concatenates anyway."""
    target, drafter = model_pair("llama", "sdpa", draft_layers=1)
    ids = random_prompt(150, seed=2)
    expected = target.generate(ids, do_sample=False, max_new_tokens=20)
    cache = GrowableCache(config=target.config, initial_capacity=256)
    with torch.inference_mode():
        target(ids[:, :120], cache=cache)
    assert cache.layers[0].key_buffer.is_inference()
    out = target.generate(
        ids,
        assistant_model=drafter,
        cache_implementation="budgeted",
        do_sample=False,
        max_new_tokens=20,
        cache=cache,
    )
    assert torch.equal(out, expected) and not cache.layers[0].key_buffer.is_inference()
    with torch.inference_mode():  # and back: writing ordinary tensors inside inference mode is allowed
        target(out[:, -1:], cache=cache)
    assert cache.get_seq_length() == out.shape[1]
