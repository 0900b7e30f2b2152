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


def _random(batch, heads, length, dim=16, seed=0):
    return torch.randn(batch, heads, length, dim, generator=torch.Generator().manual_seed(seed))


def oracle_triforce_last_query(keys, queries, budget, size):
    """TriForce chunk retrieval scored by the last prefix query, one (row, KV head) at a time.

    The package's conventions: the proxy of a KV head is the mean of its GQA group's last queries, chunk 0 is
    always kept, the trailing partial chunk (the most recent `L % size` tokens) is always kept, and the
    remaining budget is filled with whole chunks, best score first."""
    batch, kv_heads, length, _ = keys.shape
    if length <= budget:
        return [[set(range(length))] * kv_heads for _ in range(batch)]
    group = queries.shape[1] // kv_heads
    num_chunks, tail = length // size, length % size
    whole_chunks = (budget - tail) // size
    rows = []
    for b in range(batch):
        heads = []
        for h in range(kv_heads):
            proxy = queries[b, h * group : (h + 1) * group, -1].mean(dim=0)
            scores = torch.stack(
                [
                    torch.dot(keys[b, h, c * size : (c + 1) * size].mean(dim=0), proxy)
                    for c in range(num_chunks)
                ]
            )
            ranked = [c for c in scores.argsort(descending=True).tolist() if c != 0]
            chunks = [0, *ranked[: whole_chunks - 1]]
            kept = {c * size + i for c in chunks for i in range(size)}
            heads.append(kept | set(range(num_chunks * size, length)))
        rows.append(heads)
    return rows


def oracle_snapkv(keys, queries, budget, window, kernel):
    """SnapKV's `update_kv` (observation-window attention, causal inside the window, softmax, summed over the
    window queries, max-pooled, top-k, window kept), with the package's GQA convention: the summed attention is
    averaged over the query heads sharing a KV head before pooling. The queries arrive already scaled."""
    batch, kv_heads, length, _ = keys.shape
    if length <= budget:
        return [[set(range(length))] * kv_heads for _ in range(batch)]
    group = queries.shape[1] // kv_heads
    rows = []
    for b in range(batch):
        heads = []
        for h in range(kv_heads):
            summed = torch.zeros(length - window)
            for g in range(group):
                q = queries[b, h * group + g, -window:]  # (w, D)
                weights = q @ keys[b, h].T  # (w, L)
                mask = torch.full((window, window), torch.finfo(weights.dtype).min)
                cond = torch.arange(window)
                mask.masked_fill_(cond < (cond + 1).view(window, 1), 0)
                weights[:, -window:] += mask
                weights = torch.softmax(weights, dim=-1, dtype=torch.float32)
                summed += weights[:, :-window].sum(dim=0)
            summed /= group
            pooled = torch.nn.functional.max_pool1d(summed[None], kernel, stride=1, padding=kernel // 2)[0]
            chosen = set(pooled.topk(budget - window).indices.tolist())
            heads.append(chosen | set(range(length - window, length)))
        rows.append(heads)
    return rows


def oracle_streaming(length, budget, sink, batch, heads):
    """StreamingLLM: the first `sink` tokens and the most recent `budget - sink`."""
    if length <= budget:
        kept = set(range(length))
    else:
        kept = set(range(sink)) | set(range(length - (budget - sink), length))
    return [[kept] * heads for _ in range(batch)]


def _as_sets(positions):
    assert torch.equal(positions, positions.sort(dim=-1).values), "positions are not ascending"
    return [[set(head) for head in row] for row in positions.tolist()]


@pytest.mark.parametrize("size", [4, 8])
@pytest.mark.parametrize("length", [96, 101, 131, 40])
@pytest.mark.parametrize("budget", [15, 24, 37, 64])
def test_chunk_last_query_matches_triforce_oracle(size, length, budget):
    if budget < 2 * size - 1:
        pytest.skip("below the policy's minimum budget")
    keys, queries = _random(2, 2, length, seed=length), _random(2, 4, length, seed=length + 1)
    got = ChunkPolicy(chunk_size=size, query_proxy="last_query").select(keys, budget, queries)
    assert _as_sets(got) == oracle_triforce_last_query(keys, queries, budget, size)


@pytest.mark.parametrize("length,budget,window,kernel", [(80, 30, 8, 5), (97, 41, 16, 7), (64, 17, 4, 1)])
@pytest.mark.parametrize("query_heads", [2, 4])
def test_snapkv_matches_snapkv_oracle(length, budget, window, kernel, query_heads):
    keys, queries = _random(2, 2, length, seed=length), _random(2, query_heads, length, seed=length + 7) / 4
    got = SnapKVPolicy(window_size=window, kernel_size=kernel).select(keys, budget, queries)
    assert _as_sets(got) == oracle_snapkv(keys, queries, budget, window, kernel)


@pytest.mark.parametrize("length,budget,sink", [(50, 10, 4), (101, 33, 8), (20, 33, 8), (64, 9, 0)])
def test_streaming_matches_streaming_oracle(length, budget, sink):
    got = StreamingPolicy(num_sink_tokens=sink).select(_random(2, 3, length), budget)
    assert _as_sets(got) == oracle_streaming(length, budget, sink, 2, 3)


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


@pytest.mark.parametrize(
    "length,budget,kept",
    [
        (96, 40, 40),  # whole chunks only, budget a multiple of chunk_size
        (96, 37, 32),  # budget not a multiple: rounded down to whole chunks
        (103, 40, 39),  # 7-token tail + 4 whole chunks; an eighth of a chunk short of the budget
        (100, 40, 36),  # 4-token tail + 4 whole chunks
        (101, 37, 37),  # 5-token tail + 4 whole chunks fill the budget exactly
        (30, 64, 30),  # shorter than the budget: everything
    ],
)
def test_chunk_keeps_whole_chunks_plus_the_tail(length, budget, kept):
    keys, queries = _random(1, 2, length), _random(1, 4, length, seed=1)
    for proxy in ("last_key", "last_query"):
        got = ChunkPolicy(chunk_size=8, query_proxy=proxy).select(keys, budget, queries)
        assert got.shape == (1, 2, kept)
        assert (got[..., 1:] > got[..., :-1]).all()  # distinct and ascending


@pytest.mark.parametrize("length,budget", [(103, 40), (100, 37), (30, 64)])
def test_streaming_and_snapkv_fill_the_budget(length, budget):
    keys, queries = _random(1, 2, length), _random(1, 4, length, seed=1)
    kept = min(budget, length)
    assert StreamingPolicy(num_sink_tokens=4).select(keys, budget).shape == (1, 2, kept)
    assert SnapKVPolicy(window_size=8, kernel_size=5).select(keys, budget, queries).shape == (1, 2, kept)
