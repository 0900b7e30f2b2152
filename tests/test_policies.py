"""Each KV-selection policy against a naive reference, plus its invariants and errors."""

import pytest
import torch

from hf_budgetdraft.cache.policies import ChunkPolicy, SnapKVPolicy, StreamingPolicy, get_policy


def _keys(length, heads=2, dim=8, seed=0):
    return torch.randn(1, heads, length, dim, generator=torch.Generator().manual_seed(seed))


def naive_chunk(keys, budget, size):
    """Loop-by-loop BudgetDraft chunk retrieval for one batch row."""
    _, heads, length, _ = keys.shape
    if length <= budget:
        return [list(range(length))] * heads
    num_chunks, tail = length // size, length % size
    result = []
    for h in range(heads):
        proxy = keys[0, h, -1]
        scores = [float(keys[0, h, c * size : (c + 1) * size].mean(0) @ proxy) for c in range(num_chunks)]
        others = sorted(range(1, num_chunks), key=lambda c: -scores[c])[: (budget - tail) // size - 1]
        chunks = sorted([0, *others])
        result.append(
            [c * size + i for c in chunks for i in range(size)] + list(range(num_chunks * size, length))
        )
    return result


@pytest.mark.parametrize(
    "length,budget,size", [(100, 32, 8), (103, 40, 8), (64, 64, 8), (30, 64, 8), (257, 51, 4)]
)
def test_chunk_matches_naive_reference(length, budget, size):
    keys = _keys(length)
    got = ChunkPolicy(chunk_size=size).select(keys, budget)
    assert got.tolist()[0] == naive_chunk(keys, budget, size)
    assert got.shape[-1] <= budget


def test_streaming_keeps_sink_and_recent():
    got = StreamingPolicy(num_sink_tokens=4).select(_keys(50), 10)
    assert got[0, 0].tolist() == [0, 1, 2, 3, 44, 45, 46, 47, 48, 49]


def naive_snapkv(keys, queries, budget, window, kernel):
    _, heads, length, _ = keys.shape
    group = queries.shape[1] // heads
    result = []
    for h in range(heads):
        total = torch.zeros(length - window)
        for g in range(group):
            q = queries[0, h * group + g, -window:]
            for i in range(window):
                logits = q[i] @ keys[0, h, : length - window + i + 1].T
                total += logits.softmax(-1)[: length - window] / group
        pooled = torch.nn.functional.max_pool1d(total[None, None], kernel, 1, kernel // 2)[0, 0]
        chosen = sorted(pooled.topk(budget - window).indices.tolist())
        result.append(chosen + list(range(length - window, length)))
    return result


def test_snapkv_matches_naive_reference():
    keys, queries = _keys(80, heads=2), _keys(80, heads=4, seed=1)
    got = SnapKVPolicy(window_size=8, kernel_size=5).select(keys, 30, queries)
    assert got.tolist()[0] == naive_snapkv(keys, queries, 30, 8, 5)


def test_chunk_with_query_proxy_uses_queries():
    keys, queries = _keys(120), _keys(120, heads=4, seed=3)
    by_key = ChunkPolicy().select(keys, 40)
    by_query = ChunkPolicy(query_proxy="last_query").select(keys, 40, queries)
    assert by_query.shape == by_key.shape and not torch.equal(by_key, by_query)


@pytest.mark.parametrize(
    "make,budget,match",
    [
        (lambda: ChunkPolicy(chunk_size=8), 14, "budget=14 is too small"),
        (lambda: StreamingPolicy(num_sink_tokens=8), 8, "budget=8 is too small"),
        (lambda: SnapKVPolicy(window_size=32), 32, "budget=32 is too small"),
    ],
)
def test_budget_too_small(make, budget, match):
    with pytest.raises(ValueError, match=match):
        make().select(_keys(100), budget, _keys(100, heads=4))


def test_policy_errors():
    with pytest.raises(ValueError, match="unknown policy='h2o'"):
        get_policy("h2o")
    with pytest.raises(ValueError, match="bad policy_kwargs"):
        get_policy("chunk", window_size=3)
    with pytest.raises(ValueError, match="kernel_size"):
        SnapKVPolicy(kernel_size=4)
    with pytest.raises(ValueError, match="needs the prefill queries"):
        SnapKVPolicy(window_size=4).select(_keys(100), 20)
    with pytest.raises(TypeError, match="budget must be an int"):
        ChunkPolicy().select(_keys(100), 20.0)
