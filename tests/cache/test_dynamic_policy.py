"""The dynamic chunk policy: every draft step selects the prompt's chunks again with its own query.

- the policy against a naive loop (exact scores, and SparQ's scores on the query's largest channels);
- a step of a tiny model attends to the chunks its own query selects, before attending (on the dynamic and the static
  storage): the same logits as a cache that kept exactly those positions from the start;
- the prompt the layer keeps to select from is counted in its bytes;
- every single-sequence path stays lossless, a static cache's step compiled into one graph included;
- refused where it cannot run: a missing query hand-over, a batch, a training view.
"""

import pytest
import torch
from compile_counter import graph_counter
from test_generate_equivalence import CACHES, NEW_TOKENS, speculate
from tiny_models import model_pair, random_prompt
from torch_support import needs_traceable_transformers
from transformers import CompileConfig
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from hf_budgetdraft import BudgetedCache, query_capture
from hf_budgetdraft.cache import KeepPolicy
from hf_budgetdraft.cache.policies import DynamicChunkPolicy
from hf_budgetdraft.cache.ragged_draft import RaggedBudgetedCache

pytestmark = pytest.mark.usefixtures("one_thread")

BUDGET, SIZE = 20, 4


def naive_reselect(keys, query, budget, size, components):
    """Loop-by-loop: per KV head, the chunks whose largest `q·k` (over the chunk's keys and the query heads sharing
    the head, on the `components` channels where the group's |q| sums largest, all of them when 3 · components >= D)
    is largest; chunk 0 and the trailing partial chunk always."""
    _, heads, length, dim = keys.shape
    group = query.shape[1] // heads
    num_chunks, tail = length // size, length % size
    result = []
    for h in range(heads):
        q = query[0, h * group : (h + 1) * group]  # (G, D)
        channels = list(range(dim))
        if components > 0 and 3 * components < dim:  # else exact: fewer passes over the keys
            channels = q.abs().sum(0).topk(components).indices.tolist()
        scores = [
            max(
                float(q[g, channels] @ keys[0, h, p, channels])
                for g in range(group)
                for p in range(c * size, (c + 1) * size)
            )
            for c in range(num_chunks)
        ]
        others = sorted(range(1, num_chunks), key=lambda c: -scores[c])[: (budget - tail) // size - 1]
        result.append(
            [c * size + i for c in sorted([0, *others]) for i in range(size)]
            + list(range(num_chunks * size, length))
        )
    return result


@pytest.mark.parametrize("components", [0, 3, 6])  # exact, 3 of 16 channels, exact (3 · 6 >= 16)
@pytest.mark.parametrize("length", [61, 64])
def test_reselect_matches_a_naive_loop(components, length):
    generator = torch.Generator().manual_seed(length + components)
    keys = torch.randn(1, 2, length, 16, generator=generator)
    query = torch.randn(1, 4, 16, generator=generator)  # 4 query heads over 2 KV heads
    values = torch.randn(1, 2, length, 16, generator=generator)
    policy = DynamicChunkPolicy(chunk_size=SIZE, components=components)
    index = policy.index(keys, values)
    chunks, kept_keys, kept_values = policy.reselect(index, query, BUDGET)
    positions = policy.positions(chunks, index)
    assert positions.tolist()[0] == naive_reselect(keys, query, BUDGET, SIZE, components)
    assert positions.shape[-1] == policy.select(keys, BUDGET).shape[-1]  # as many as the prefill kept
    index = positions[..., None].expand(-1, -1, -1, 16)
    assert torch.equal(kept_keys, keys.gather(2, index)) and torch.equal(kept_values, values.gather(2, index))


@pytest.mark.parametrize("components", [0, 3])  # exact, 3 of 16 channels (each query its own)
def test_choosing_for_many_queries_at_once_is_choosing_for_each_alone(components):
    generator = torch.Generator().manual_seed(components)
    keys, values = (
        torch.randn(2, 2, 61, 16, generator=generator),
        torch.randn(2, 2, 61, 16, generator=generator),
    )
    queries = torch.randn(2, 4, 7, 16, generator=generator)  # 7 queries, 4 query heads over 2 KV heads
    policy = DynamicChunkPolicy(chunk_size=SIZE, components=components)
    index = policy.index(keys, values)
    together = policy.choose(index, queries, BUDGET)  # (B, H_kv, 7, k)
    alone = torch.stack([policy.reselect(index, queries[:, :, t], BUDGET)[0] for t in range(7)], dim=2)
    assert torch.equal(together, alone)
    assert (
        len({tuple(c) for c in together[0, 0].tolist()}) > 1
    )  # the queries choose differently: the check has power
    positions = policy.positions(together, index)  # (B, H_kv, 7, n): the prefill's count each
    assert positions.shape == (2, 2, 7, policy.select(keys, BUDGET).shape[-1])


def test_a_query_finds_a_key_planted_far_back_on_few_channels():
    """The approximate score reads 2 of 16 channels, and finds the chunk the query points at."""
    keys = torch.randn(1, 1, 200, 16, generator=torch.Generator().manual_seed(0)) * 0.1
    keys[0, 0, 101, 5] = 4.0
    query = torch.zeros(1, 1, 16)
    query[0, 0, 5] = 1.0
    policy = DynamicChunkPolicy(chunk_size=8, components=2)
    index = policy.index(keys, keys)
    assert 101 in policy.positions(policy.reselect(index, query, 24)[0], index)[0, 0].tolist()
    assert 101 not in policy.select(keys, 24)[0, 0].tolist()  # the prefill's proxy (the last key) missed it


class KeepThese(KeepPolicy):
    """Keeps the positions `(1, H, n)` it is given: the reference cache of one step's selection."""

    name = "these"

    def __init__(self, positions):
        self.positions = positions

    def min_budget(self) -> int:
        return 1

    def _select(self, keys, budget, queries):
        return self.positions


def step_query(drafter, token, position: int) -> torch.Tensor:
    """The query `(1, H_q, D)` of a one-layer Llama drafter's step at `position`, RoPE applied, times the scaling."""
    model, attention = drafter.model, drafter.model.layers[0].self_attn
    hidden = drafter.model.layers[0].input_layernorm(model.embed_tokens(token))
    query = attention.q_proj(hidden).view(1, 1, -1, attention.head_dim).transpose(1, 2)
    cos, sin = model.rotary_emb(hidden, torch.tensor([[position]]))
    query, _ = apply_rotary_pos_emb(query, query, cos, sin)
    return query[:, :, -1] * attention.scaling


@pytest.mark.parametrize("static", [False, True])
def test_each_step_attends_to_the_chunks_its_own_query_selects(static):
    """Each step after the prefill re-selects with its own query before its attention reads the keys: its logits
    equal those of a cache that kept, from the prefill on, exactly the positions that step selected. (One layer, so
    the window's keys do not depend on what earlier steps read.)"""
    _, drafter = model_pair("llama", "budgetdraft_varlen" if static else "sdpa", draft_layers=1)
    prompt, steps = random_prompt(90, seed=3), random_prompt(4, seed=4)
    kwargs = dict(budget=BUDGET, window_length=8, static=static)
    cache = BudgetedCache(
        drafter.config, policy="dynamic", policy_kwargs={"chunk_size": SIZE, "components": 4}, **kwargs
    )
    logits, chosen = [], []
    with torch.no_grad(), query_capture(drafter):
        drafter(prompt, cache=cache)
        prefill_choice = cache.layers[0].kept_positions.clone()
        for k in range(steps.shape[1]):
            logits.append(drafter(steps[:, k : k + 1], cache=cache).logits[0, -1])
            chosen.append(cache.layers[0].kept_positions.clone())
    assert any(not torch.equal(c, prefill_choice) for c in chosen)  # the steps did select otherwise
    policy, index = cache.layers[0].selection.policy, cache.layers[0].prompt
    for k, positions in enumerate(chosen):  # each with its own query
        query = step_query(drafter, steps[:, k : k + 1], prompt.shape[1] + k)
        assert torch.equal(positions, policy.positions(policy.reselect(index, query, BUDGET)[0], index))
    for k, positions in enumerate(chosen):
        reference = BudgetedCache(drafter.config, policy=KeepThese(positions), **kwargs)
        with torch.no_grad():
            drafter(prompt, cache=reference)
            expected = drafter(steps[:, : k + 1], cache=reference).logits[0, -1]
        torch.testing.assert_close(logits[k], expected)


def test_the_prompt_kept_to_select_from_is_counted():
    _, drafter = model_pair("llama", "sdpa")
    prompt = random_prompt(90)
    caches = {
        p: BudgetedCache(drafter.config, budget=BUDGET, policy=p, window_length=8)
        for p in ("chunk", "dynamic")
    }
    with torch.no_grad(), query_capture(drafter):
        for cache in caches.values():
            drafter(prompt, cache=cache)
    layer = caches["dynamic"].layers[0]
    prompt_bytes = sum(t.numel() * t.element_size() for t in layer.prompt)
    per_position = layer.keys[:, :, :1].numel() * layer.keys.element_size()
    # keys and values by chunk, plus the keys of the 88 positions in whole chunks channel-major
    kv_bytes = sum(t.numel() * t.element_size() for t in layer.prompt if t.is_floating_point())
    assert kv_bytes == (2 * 90 + 88) * per_position
    layers = len(caches["dynamic"].layers)
    assert caches["dynamic"].nbytes() == caches["chunk"].nbytes() + prompt_bytes * layers


@pytest.mark.parametrize(
    "run", [{}, {"static": False}, {"static": True, "lean_step": False}, {"device_round": True}], ids=str
)
def test_every_single_sequence_path_stays_lossless(run):
    """The lean step, the drafter's own forward on either storage, and the device round's own loop: each step's
    queries reach the cache (else the next step raises) and the output is the target's."""
    target, drafter = model_pair("llama", "sdpa", num_assistant_tokens=None)
    ids = random_prompt(240)
    out, _ = speculate(
        target, drafter, ids, "budgeted", cache_config={**CACHES["budgeted-dynamic"][1], **run}
    )
    assert torch.equal(out, target.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS))


@needs_traceable_transformers
def test_a_static_step_reselects_inside_its_compiled_graph():
    """On a static cache the step re-selects inside the attention function, with fixed shapes: the one-token step
    compiles into one graph (`fullgraph=True`) reused over the whole call, and the output is still the target's."""

    target, drafter = model_pair("llama", "budgetdraft_varlen", num_assistant_tokens=None)
    backend, graphs = graph_counter()
    drafter.generation_config.compile_config = CompileConfig(fullgraph=True, backend=backend, mode=None)
    ids = random_prompt(240)
    torch._dynamo.reset()
    try:
        config = {"budget": 48, "policy": "dynamic", "static": True, "draft_length": 3}
        out, stats = speculate(target, drafter, ids, "budgeted", cache_config=config)
    finally:
        torch._dynamo.reset()
    assert torch.equal(out, target.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS))
    assert len(graphs) == 1 and stats.runtime["draft_step"]["compiled_calls"] > 10


# ---------------------------------------------------------------------------------------------------------------
# refused where it cannot run
# ---------------------------------------------------------------------------------------------------------------


def test_a_step_whose_queries_never_arrived_is_refused():
    """Outside `query_capture` the attention hands no query over: the next step says so instead of drafting on a stale
    selection."""
    _, drafter = model_pair("llama", "sdpa")
    cache = BudgetedCache(drafter.config, budget=BUDGET, policy="dynamic", window_length=8)
    with torch.no_grad():
        drafter(random_prompt(90), cache=cache)
        drafter(random_prompt(1), cache=cache)
        with pytest.raises(ValueError, match="did not hand them over"):
            drafter(random_prompt(1), cache=cache)


def test_where_the_dynamic_policy_cannot_run():
    target, drafter = model_pair("llama", "sdpa")
    with pytest.raises(ValueError, match="ragged per-row caches"):
        RaggedBudgetedCache(drafter.config, batch_size=2, budget=BUDGET, policy="dynamic")
    with pytest.raises(ValueError, match="components must be"):
        DynamicChunkPolicy(components=-1)
