"""Contract tests of the sparse draft caches: every selection on every storage (dynamic, static, ragged) against one
oracle — a full `DynamicLayer` restricted to the positions the selection says are visible — and one rollback rule.
Random prefill/update/crop sequences come from hypothesis."""

import pytest
import torch
from draft_cache_cases import BUDGET_POLICIES, DIM, HEADS, SLACK, random_kv
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig
from transformers.cache_utils import DynamicLayer

from hf_budgetdraft.attention.varlen import STATIC_LAYER_KWARG
from hf_budgetdraft.cache import BudgetSelection, DraftLayer, SinkSelection, StaticDraftLayer, get_policy
from hf_budgetdraft.cache.ragged_draft import RaggedDraftCache

pytestmark = pytest.mark.usefixtures("one_thread")

STORAGES = ("dynamic", "static", "ragged")

operations = st.lists(
    st.one_of(
        st.tuples(st.just("update"), st.integers(1, 9)),
        st.tuples(st.just("crop"), st.integers(0, 9)),
    ),
    max_size=30,
)


def _ordered_slots(mask: torch.Tensor, held: torch.Tensor, static_capacity: int) -> torch.Tensor:
    """The slots a `(S + W + slack,)` mask shows, in the dynamic layer's order: static slots by index (a sink slot
    holds its own position, kept slots the selection in order), then ring slots by the position each holds."""
    static = mask[:static_capacity].nonzero().squeeze(1)
    ring = mask[static_capacity:].nonzero().squeeze(1)
    ring = ring[held[static_capacity:][ring].argsort()] + static_capacity
    return torch.cat([static, ring])


class Storage:
    """One attention layer of a storage, driven like a model drives it: `update` returns, per new query, the keys
    and values it reads in position order (`(1, H, n_i, D)` each); `crop` says whether it refused."""

    def __init__(self, kind: str, selection, window: int):
        self.kind = kind
        if kind == "ragged":
            config = LlamaConfig(
                num_hidden_layers=1,
                num_attention_heads=HEADS,
                num_key_value_heads=HEADS,
                hidden_size=HEADS * DIM,
            )
            self.cache = RaggedDraftCache(config, 1, selection, window, SLACK)
            self.layer = self.cache.layers[0]
        else:
            self.layer = (StaticDraftLayer if kind == "static" else DraftLayer)(selection, window, SLACK)
        self.length = 0

    def max_update(self) -> int:
        return SLACK if self.kind == "ragged" else 1 << 20  # a ragged forward writes at most `slack` per row

    def update(self, keys, values, queries=None):
        n = keys.shape[-2]
        if self.kind == "ragged":
            shown = self._ragged_update(keys, values, queries)
        else:
            attention_kwargs = {}
            out_keys, out_values = self.layer.update(keys, values, kwargs=attention_kwargs)
            if queries is not None:
                self.layer.receive_queries(queries)
            if STATIC_LAYER_KWARG in attention_kwargs:
                mask = self.layer.consume_key_mask()[0, 0]  # (q, S + W + slack)
                held = self.layer.slot_positions
                shown = [self._slots(mask[i], held, self.layer.static_capacity) for i in range(n)]
            else:
                past = out_keys.shape[-2] - n
                shown = [(out_keys[:, :, : past + i + 1], out_values[:, :, : past + i + 1]) for i in range(n)]
        self.length += n
        assert self.stored_length() == self.length
        return shown

    def stored_length(self) -> int:
        return int(self.cache.lengths[0] if self.kind == "ragged" else self.layer.get_seq_length())

    def _ragged_update(self, keys, values, queries):
        n = keys.shape[-2]
        if self.length == 0:
            self.cache.prefill_row(0, n, keys.device)
            out = self.layer.update(keys, values)
            if queries is not None:
                self.layer.receive_queries(queries)
            return [(out[0][:, :, : i + 1], out[1][:, :, : i + 1]) for i in range(n)]
        mask = self.cache.step_mask(n, torch.float32)[0, 0] == 0  # (q, S + W + slack), additive -> bool
        self.layer.update(keys, values)
        held = self.cache.slot_positions[0]
        return [self._slots(mask[i], held, self.cache.static_capacity) for i in range(n)]

    def _slots(self, mask, held, static_capacity):
        slots = _ordered_slots(mask, held, static_capacity)
        return self.layer.keys[:1, :, slots], self.layer.values[:1, :, slots]

    def crop(self, n: int) -> bool:
        try:
            if self.kind == "ragged":
                self.cache.crop_rows(torch.tensor([n]))
            else:
                self.layer.crop(-n)
        except ValueError:
            assert self.stored_length() == self.length  # refused: unchanged
            return True
        self.length -= n
        assert self.stored_length() == self.length
        return False


def _oracle_visible(oracle, positions):
    """Oracle keys/values at `positions`: `(H, n)` per-head or `(n,)` shared indices."""
    index = positions if positions.dim() == 2 else positions.expand(HEADS, -1)
    index = index[None, :, :, None].expand(1, HEADS, index.shape[-1], DIM)
    return oracle.keys.gather(2, index), oracle.values.gather(2, index)


def _visible_positions(selection, kept, prompt_length, window, query):
    """`(H, n)` positions a query at `query` (after a prompt of `prompt_length`) reads, before the new block."""
    ring_start = selection.ring_start(prompt_length)
    static = kept if isinstance(selection, BudgetSelection) else torch.arange(min(ring_start, query))
    first = max(ring_start, query - window)
    ring = torch.arange(min(first, query), query)
    return torch.cat([static.expand(HEADS, -1), ring.expand(HEADS, -1)], dim=-1)


def run_sequence(storage: Storage, selection, window, prefill, ops, seed, queries_for=None):
    """Drive `storage` and an oracle through the same prefill, updates and crops: every query reads exactly what
    the selection and the window say; a crop is refused only when the rollback rule says it cannot be exact."""
    generator = torch.Generator().manual_seed(seed)
    oracle, length, max_written, prompt, kept = DynamicLayer(), 0, 0, None, None
    for kind, n in [("update", prefill), *ops]:
        if kind == "update":
            n = min(n, storage.max_update()) if prompt is not None else n
            keys, values = random_kv(n, generator)
            queries = queries_for(n, generator) if queries_for is not None and prompt is None else None
            shown = storage.update(keys, values, queries)
            oracle.update(keys, values)
            oracle.keys, oracle.values = oracle.keys[:, :, : length + n], oracle.values[:, :, : length + n]
            if prompt is None:
                prompt, kept = n, getattr(storage.layer, "kept_positions", None)
                if kept is None:  # ragged: the selection is deterministic given the same keys and queries
                    kept = selection.select(keys, queries)
                kept = kept[0]
                expected = [_oracle_visible(oracle, torch.arange(i + 1)) for i in range(n)]
            else:
                expected = []
                for i in range(n):
                    past = _visible_positions(selection, kept, prompt, window, length)
                    block = torch.arange(length, length + i + 1).expand(HEADS, -1)
                    expected.append(_oracle_visible(oracle, torch.cat([past, block], dim=-1)))
            for (got_k, got_v), (want_k, want_v) in zip(shown, expected, strict=True):
                torch.testing.assert_close(got_k, want_k, rtol=0, atol=0)
                torch.testing.assert_close(got_v, want_v, rtol=0, atol=0)
            length += n
            max_written = max(max_written, length)
        elif storage.crop(n):
            # the one rollback rule: refused only past the slack below the furthest length, or before the floor
            assert max_written - (length - n) > SLACK or length - n < selection.floor(prompt), (
                max_written,
                length,
                n,
            )
        else:
            if n:
                oracle.crop(-n)
            length -= n


@pytest.mark.parametrize("storage", STORAGES)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sink=st.integers(0, 5),
    window=st.integers(1, 12),
    prefill=st.integers(1, 60),
    ops=operations,
    seed=st.integers(0, 2**16),
)
def test_sink_selection_matches_oracle_on_every_storage(storage, sink, window, prefill, ops, seed):
    selection = SinkSelection(sink)
    run_sequence(Storage(storage, selection, window), selection, window, prefill, ops, seed)


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize(
    "policy,kwargs,budget",
    BUDGET_POLICIES,
)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(window=st.integers(1, 12), prefill=st.integers(1, 60), ops=operations, seed=st.integers(0, 2**16))
def test_budget_selection_matches_oracle_on_every_storage(
    storage, policy, kwargs, budget, window, prefill, ops, seed
):
    selection = BudgetSelection(budget, get_policy(policy, **kwargs))
    queries = (
        (lambda n, g: torch.randn(1, 2 * HEADS, n, DIM, generator=g)) if selection.uses_queries else None
    )
    run_sequence(
        Storage(storage, selection, window), selection, window, prefill, ops, seed, queries_for=queries
    )


def test_budget_selection_is_the_policy_on_the_prefix():
    generator = torch.Generator().manual_seed(0)
    keys, values = random_kv(50, generator)
    policy = get_policy("chunk", chunk_size=4)
    layer = DraftLayer(BudgetSelection(16, policy), window_length=8, slack=4)
    layer.update(keys, values)
    assert torch.equal(layer.kept_positions, policy.select(keys, 16))
    kept = layer.kept_positions[0, 1]
    assert layer.num_kept == len(kept) == 14  # 3 chunks of 4 (chunk 0 + top 2) + the 2-token tail
    torch.testing.assert_close(layer.keys[0, 1, : layer.num_kept], keys[0, 1, kept], rtol=0, atol=0)


@pytest.mark.parametrize("layer_class", [DraftLayer, StaticDraftLayer])
def test_crop_beyond_slack_raises_and_leaves_cache_intact(layer_class):
    generator = torch.Generator().manual_seed(0)
    layer = layer_class(SinkSelection(2), window_length=8, slack=4)
    layer.update(*random_kv(40, generator))
    layer.update(*random_kv(4, generator), kwargs={})
    if layer_class is StaticDraftLayer:  # a step hands its mask to attention
        assert layer.consume_key_mask().shape == (1, 1, 4, layer.num_slots)
    with pytest.raises(ValueError, match="larger `slack`"):
        layer.crop(-5)
    assert int(layer.get_seq_length()) == 44
    layer.crop(torch.tensor(-4))  # transformers' candidate generator passes a tensor for a static cache
    assert int(layer.get_seq_length()) == 40
    with pytest.raises(ValueError, match="negative count"):
        layer.crop(3)


@pytest.mark.parametrize("layer_class", [DraftLayer, StaticDraftLayer])
def test_budgeted_refuses_to_crop_into_compressed_prefix(layer_class):
    layer = layer_class(BudgetSelection(16, "streaming"), window_length=8, slack=4)
    layer.update(*random_kv(40, torch.Generator().manual_seed(0)))
    with pytest.raises(ValueError, match="compressed prefix"):
        layer.crop(-1)
    assert int(layer.get_seq_length()) == 40
