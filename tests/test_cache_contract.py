"""Contract tests of the sparse draft cache layers against an oracle: a full `DynamicLayer` restricted to
the positions the policy says are visible. Random prefill/update/crop sequences come from hypothesis."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers.cache_utils import DynamicLayer

from hf_budgetdraft.cache import BudgetedLayer, SinkWindowLayer, get_policy

HEADS, DIM = 2, 4
SLACK = 6

operations = st.lists(
    st.one_of(
        st.tuples(st.just("update"), st.integers(1, 9)),
        st.tuples(st.just("crop"), st.integers(0, 9)),
    ),
    max_size=30,
)


def _kv(n, generator):
    return (
        torch.randn(1, HEADS, n, DIM, generator=generator),
        torch.randn(1, HEADS, n, DIM, generator=generator),
    )


def _visible_oracle(oracle, positions):
    """Oracle keys/values at `positions`: `(H, n)` per-head or `(n,)` shared indices."""
    index = positions if positions.dim() == 2 else positions.expand(HEADS, -1)
    index = index[None, :, :, None].expand(1, HEADS, index.shape[-1], DIM)
    return oracle.keys.gather(2, index), oracle.values.gather(2, index)


def _sink_window_visible(layer, length):
    sink = list(range(min(layer.num_sink_tokens, length)))
    window = list(range(max(layer.num_sink_tokens, length - layer.ring.window), length))
    return torch.tensor(sink + window, dtype=torch.long)


def _budgeted_visible(layer, length):
    window = torch.arange(max(layer.prefix_length, length - layer.ring.window), length)
    return torch.cat([layer.kept_positions[0], window.expand(HEADS, -1)], dim=-1)


def run_sequence(layer, visible, prefill, ops, seed, queries_for=None):
    generator = torch.Generator().manual_seed(seed)
    oracle, length, max_written = DynamicLayer(), 0, 0
    for step, (kind, n) in enumerate([("update", prefill), *ops]):
        if kind == "update":
            keys, values = _kv(n, generator)
            kv_length, kv_offset = layer.get_mask_sizes(n)
            if step == 0 or length == 0:
                expected_past = None
            else:
                expected_past = _visible_oracle(oracle, visible(layer, length))
            out_keys, out_values = layer.update(keys, values)
            if queries_for is not None and step == 0:
                layer.receive_queries(queries_for(n, generator))
            oracle.update(keys, values)
            oracle.keys, oracle.values = oracle.keys[:, :, : length + n], oracle.values[:, :, : length + n]
            if expected_past is not None:
                torch.testing.assert_close(
                    out_keys, torch.cat([expected_past[0], keys], dim=2), rtol=0, atol=0
                )
                torch.testing.assert_close(
                    out_values, torch.cat([expected_past[1], values], dim=2), rtol=0, atol=0
                )
            assert out_keys.shape[2] == kv_length, "get_mask_sizes disagrees with the keys returned"
            assert kv_offset == length - (kv_length - n)
            length += n
            max_written = max(max_written, length)
        else:
            protected = getattr(layer, "prefix_length", 0) or 0
            try:
                layer.crop(-n)
            except ValueError:
                # it may refuse only what it cannot restore: more than `slack` below the furthest length reached
                assert max_written - (length - n) > SLACK or length - n < protected, (max_written, length, n)
                continue
            if n:
                oracle.crop(-n)
            length -= n
        assert layer.get_seq_length() == length
    return layer


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sink=st.integers(0, 5),
    window=st.integers(1, 12),
    prefill=st.integers(1, 60),
    ops=operations,
    seed=st.integers(0, 2**16),
)
def test_sink_window_layer_matches_oracle(sink, window, prefill, ops, seed):
    layer = SinkWindowLayer(num_sink_tokens=sink, window_length=window, slack=SLACK)
    run_sequence(layer, _sink_window_visible, prefill, ops, seed)


@pytest.mark.parametrize(
    "policy,kwargs,budget",
    [
        ("chunk", {"chunk_size": 4}, 12),
        ("streaming", {"num_sink_tokens": 2}, 9),
        ("snapkv", {"window_size": 3}, 10),
    ],
)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(window=st.integers(1, 12), prefill=st.integers(1, 60), ops=operations, seed=st.integers(0, 2**16))
def test_budgeted_layer_matches_oracle(policy, kwargs, budget, window, prefill, ops, seed):
    keep = get_policy(policy, **kwargs)
    layer = BudgetedLayer(keep, budget=budget, window_length=window, slack=SLACK, layer_idx=0)
    queries = (lambda n, g: torch.randn(1, 2 * HEADS, n, DIM, generator=g)) if keep.needs_queries else None
    run_sequence(layer, _budgeted_visible, prefill, ops, seed, queries_for=queries)
    assert 0 < layer.num_kept <= min(budget, prefill)


def test_budgeted_selection_is_the_policy_on_the_prefix():
    generator = torch.Generator().manual_seed(0)
    keys, values = _kv(50, generator)
    policy = get_policy("chunk", chunk_size=4)
    layer = BudgetedLayer(policy, budget=16, window_length=8, slack=4, layer_idx=0)
    layer.update(keys, values)
    assert torch.equal(layer.kept_positions, policy.select(keys, 16))
    kept = layer.kept_positions[0, 1]
    assert layer.num_kept == len(kept) == 14  # 3 chunks of 4 (chunk 0 + top 2) + the 2-token tail
    torch.testing.assert_close(layer.static_keys[0, 1, : layer.num_kept], keys[0, 1, kept], rtol=0, atol=0)


def test_crop_beyond_slack_raises_and_leaves_cache_intact():
    generator = torch.Generator().manual_seed(0)
    layer = SinkWindowLayer(num_sink_tokens=2, window_length=8, slack=4)
    layer.update(*_kv(40, generator))
    layer.update(*_kv(4, generator))
    with pytest.raises(ValueError, match="larger `slack`"):
        layer.crop(-5)
    assert layer.get_seq_length() == 44
    layer.crop(-4)
    assert layer.get_seq_length() == 40
    with pytest.raises(ValueError, match="negative count"):
        layer.crop(3)


def test_budgeted_refuses_to_crop_into_compressed_prefix():
    layer = BudgetedLayer(get_policy("streaming"), budget=16, window_length=8, slack=4, layer_idx=0)
    layer.update(*_kv(40, torch.Generator().manual_seed(0)))
    with pytest.raises(ValueError, match="compressed prefix"):
        layer.crop(-1)
