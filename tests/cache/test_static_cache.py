"""The static draft caches (`cache_config={"static": True}`): fixed-shape decode steps that stay exact.

- contract (hypothesis): over random update/crop sequences a static layer shows a query exactly the keys the
  dynamic `DraftLayer` returns — bit for bit, recovered from the slot mask and the
  slot positions — with the same attention output, `get_mask_sizes` agreeing with `update`, and the same crops
  accepted and refused;
- compile: the one-token decode step compiles with `torch.compile(fullgraph=True)` into one graph that is reused
  at every context length (sink filling, ring wrapping, rollbacks), and computes the dynamic cache's logits;
- generation: greedy speculative decoding with a static draft cache equals the target's greedy output and drafts
  exactly what the dynamic cache drafts, also with its one-token draft step compiled (once) when a `compile_config`
  asks for it;
- errors that teach: wrong attention implementation, a family that hides its attention kwargs, bad switches.
"""

import pytest
import torch
import torch.nn.functional as F
from compile_counter import graph_counter
from draft_cache_cases import BUDGET_POLICIES, DIM, HEADS, SLACK, random_kv
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import model_pair, random_prompt, tiny_config
from torch_support import needs_traceable_transformers
from transformers import AutoModelForCausalLM, CompileConfig

from hf_budgetdraft import (
    BudgetedCache,
    SinkWindowCache,
    draft_step_compile_config,
    query_capture,
    record_speculation,
)
from hf_budgetdraft.attention.varlen import STATIC_LAYER_KWARG
from hf_budgetdraft.cache import BudgetSelection, DraftLayer, SinkSelection, StaticDraftLayer, get_policy

pytestmark = pytest.mark.usefixtures("one_thread")

GROUPS = 2


operations = st.lists(
    st.one_of(st.tuples(st.just("update"), st.integers(1, 9)), st.tuples(st.just("step"), st.integers(1, 6))),
    max_size=14,
).flatmap(
    lambda ops: st.lists(st.integers(0, 9), min_size=len(ops), max_size=len(ops)).map(
        lambda crops: [(kind, n, crop) for (kind, n), crop in zip(ops, crops, strict=True)]
    )
)


def _attend(query, keys, values, mask=None):
    """`(1, H_kv * G, q, D)` queries over `(1, H_kv, K, D)` keys, KV heads repeated (the plain reference)."""
    keys, values = keys.repeat_interleave(GROUPS, dim=1), values.repeat_interleave(GROUPS, dim=1)
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask)


def _visible_in_position_order(layer, mask):
    """The keys/values a static step shows, in the dynamic layer's order: the visible static slots by index (sink
    slot j holds position j; kept slots hold the prefix selection in order), then the visible ring slots by the
    position each holds. `(1, H, n, D)` each."""
    mask = mask.reshape(-1)  # (S + W + slack,)
    static_slots = mask[: layer.static_capacity].nonzero().squeeze(1)
    ring_visible = mask[layer.static_capacity :].nonzero().squeeze(1)
    ring_slots = (
        ring_visible[layer.slot_positions[layer.static_capacity :][ring_visible].argsort()]
        + layer.static_capacity
    )
    slots = torch.cat([static_slots, ring_slots])
    return layer.keys[:, :, slots], layer.values[:, :, slots]


def run_pair(dynamic, static, prefill, ops, seed, queries_for=None):
    """Drive a dynamic and a static layer through the same updates/steps/crops and compare what queries read."""
    generator = torch.Generator().manual_seed(seed)
    steps = 0
    for index, (kind, n, crop) in enumerate([("update", prefill, 0), *ops]):
        tokens = 1 if kind == "step" else n
        for _ in range(n if kind == "step" else 1):
            keys, values = random_kv(tokens, generator)
            sizes_dynamic, sizes_static = dynamic.get_mask_sizes(tokens), static.get_mask_sizes(tokens)
            out_dynamic = dynamic.update(keys, values)
            attention_kwargs = {}
            out_static = static.update(keys, values, kwargs=attention_kwargs)
            if queries_for is not None and index == 0:  # the prefill: hand both the same queries
                queries = queries_for(prefill, generator)
                dynamic.receive_queries(queries)
                static.receive_queries(queries)
            assert out_static[0].shape[2] == sizes_static[0], (
                "get_mask_sizes disagrees with the keys returned"
            )
            assert out_dynamic[0].shape[2] == sizes_dynamic[0]
            if STATIC_LAYER_KWARG in attention_kwargs:  # a fixed-shape step: the whole buffer + its slot mask
                steps += 1
                assert tokens <= SLACK and out_static[0].shape[2] == static.num_slots and sizes_static[1] == 0
                assert attention_kwargs[STATIC_LAYER_KWARG] is static
                mask = static.consume_key_mask()  # (1, 1, q, S + W + slack)
                assert mask.shape == (1, 1, tokens, static.num_slots)
                past = out_dynamic[0].shape[2] - tokens
                for i in range(tokens):  # query i reads the past and the step's first i + 1 tokens
                    shown = _visible_in_position_order(static, mask[:, :, i])
                    for got, expected in zip(shown, out_dynamic, strict=True):
                        torch.testing.assert_close(got, expected[:, :, : past + i + 1], rtol=0, atol=0)
                query = torch.randn(1, HEADS * GROUPS, tokens, DIM, generator=generator)
                causal = torch.ones(tokens, past + tokens, dtype=torch.bool).tril(past)
                torch.testing.assert_close(
                    _attend(query, *out_static, mask), _attend(query, *out_dynamic, causal)
                )
            else:  # a block: the dynamic layout itself
                assert sizes_static == sizes_dynamic
                for got, expected in zip(out_static, out_dynamic, strict=True):
                    torch.testing.assert_close(got, expected, rtol=0, atol=0)
            assert int(static.get_seq_length()) == dynamic.get_seq_length()
        refused = []
        for layer in (dynamic, static):
            try:
                layer.crop(-crop)
                refused.append(False)
            except ValueError:
                refused.append(True)
        assert refused[0] == refused[1], f"dynamic refused={refused[0]}, static refused={refused[1]}"
        assert int(static.get_seq_length()) == dynamic.get_seq_length()
    return steps


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sink=st.integers(0, 5),
    window=st.integers(1, 12),
    prefill=st.integers(1, 40),
    ops=operations,
    seed=st.integers(0, 2**16),
)
def test_static_sink_window_layer_matches_dynamic(sink, window, prefill, ops, seed):
    dynamic = DraftLayer(SinkSelection(sink), window_length=window, slack=SLACK)
    static = StaticDraftLayer(SinkSelection(sink), window_length=window, slack=SLACK)
    run_pair(dynamic, static, prefill, ops, seed)
    assert static.nbytes() == 2 * HEADS * (sink + window + SLACK) * DIM * 4  # bounded, whatever the context


@pytest.mark.parametrize(
    "policy,kwargs,budget",
    BUDGET_POLICIES,
)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(window=st.integers(1, 12), prefill=st.integers(1, 40), ops=operations, seed=st.integers(0, 2**16))
def test_static_budgeted_layer_matches_dynamic(policy, kwargs, budget, window, prefill, ops, seed):
    keep = get_policy(policy, **kwargs)
    dynamic = DraftLayer(BudgetSelection(budget, keep), window_length=window, slack=SLACK, layer_idx=0)
    static = StaticDraftLayer(BudgetSelection(budget, keep), window_length=window, slack=SLACK, layer_idx=0)
    queries = (
        (lambda n, g: torch.randn(1, HEADS * GROUPS, n, DIM, generator=g)) if keep.needs_queries else None
    )
    run_pair(dynamic, static, prefill, ops, seed, queries_for=queries)
    assert torch.equal(static.kept_positions, dynamic.kept_positions)


def test_contract_exercises_sink_and_ring_steps_and_wraps():
    """The sequence the hypothesis tests are built from, pinned: sink filling by steps, ring wrap, crops."""
    dynamic = DraftLayer(SinkSelection(3), window_length=4, slack=SLACK)
    static = StaticDraftLayer(SinkSelection(3), window_length=4, slack=SLACK)
    ops = [("step", 5, 2), ("update", 7, 3), ("step", 6, 6), ("step", 6, 7), ("step", 1, 0)]
    assert (
        run_pair(dynamic, static, 1, ops, seed=0) == 5 + 6 + 6 + 1
    )  # the prefill is a block, every step in place


# ---------------------------------------------------------------------------------------------------------------
# compile
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cache_class,kwargs",
    [
        (SinkWindowCache, {"num_sink_tokens": 4, "window_length": 8, "slack": 4}),
        (
            BudgetedCache,
            {"budget": 12, "policy": "chunk", "policy_kwargs": {"chunk_size": 4}, "window_length": 8},
        ),
    ],
    ids=["sink_window", "budgeted"],
)
@needs_traceable_transformers
def test_decode_step_compiles_fullgraph_once_and_matches_dynamic(cache_class, kwargs, fresh_dynamo):
    _, drafter = model_pair("llama", "budgetdraft_varlen")
    _, reference = model_pair("llama", "sdpa")
    static = cache_class(drafter.config, static=True, **kwargs)
    dynamic = cache_class(reference.config, **kwargs)
    backend, graphs = graph_counter()
    step = torch.compile(drafter.forward, backend=backend, fullgraph=True)
    ids = random_prompt(70, seed=2)
    prefill = 2 if cache_class is SinkWindowCache else 20  # sink: the first steps fill the sink slots
    with torch.no_grad():
        drafter(ids[:, :prefill], cache=static)
        reference(ids[:, :prefill], cache=dynamic)
        for t in range(prefill, 70):  # contexts 2 .. ~60: sink filling, ring wrapping (ring of 12 slots)
            length = int(static.get_seq_length())
            position = torch.tensor([[length]])
            got = step(
                input_ids=ids[:, t : t + 1], cache=static, position_ids=position, use_cache=True
            ).logits
            expected = reference(ids[:, t : t + 1], cache=dynamic, position_ids=position).logits
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
            if t % 11 == 0:  # a rejected draft tail: roll both back
                static.crop(-3)
                dynamic.crop(-3)
    assert len(graphs) == 1, f"the decode step recompiled: {len(graphs)} graphs"
    assert static.layers[0].keys.shape[2] == static.layers[0].num_slots  # the buffer never grew


def test_draft_step_compile_config_per_device():
    """One static graph either way: CUDA graphs on CUDA; elsewhere inductor's C++ wrapper (the step of a small
    drafter is mostly the Python wrapper's overhead otherwise)."""
    cpu, cuda = draft_step_compile_config("cpu"), draft_step_compile_config(torch.device("cuda", 0))
    assert (cpu.dynamic, cpu.mode, cpu.options) == (False, None, {"cpp_wrapper": True})
    assert (cuda.dynamic, cuda.fullgraph, cuda.mode) == (False, True, None)
    assert cuda.options == {"triton.cudagraphs": True, "graph_partition": False}


# ---------------------------------------------------------------------------------------------------------------
# generation
# ---------------------------------------------------------------------------------------------------------------

PROMPT_LENGTH, NEW_TOKENS = 240, 48
STATIC_CASES = {
    "sink_window": ("sink_window", {"num_sink_tokens": 4, "window_length": 32, "slack": 8}),
    "budgeted-chunk": ("budgeted", {"budget": 48, "policy": "chunk", "window_length": 16}),
    "budgeted-snapkv": ("budgeted", {"budget": 48, "policy": "snapkv", "policy_kwargs": {"window_size": 8}}),
}


def _speculate(target, drafter, ids, implementation, cache_config, **kwargs):
    with record_speculation() as stats:
        out = target.generate(
            ids,
            assistant_model=drafter,
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            cache_implementation=implementation,
            cache_config=cache_config,
            **kwargs,
        )
    return out, stats.accepted_per_round


@pytest.mark.parametrize("case", list(STATIC_CASES))
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2"])
def test_static_greedy_equals_target_and_drafts_like_dynamic(family, case):
    reference_attention = "eager" if family == "gemma2" else "sdpa"  # gemma2: softcapping, sliding layers
    target, dynamic_drafter = model_pair(family, reference_attention, num_assistant_tokens=3)
    _, drafter = model_pair(family, "budgetdraft_varlen", num_assistant_tokens=3)
    implementation, cache_config = STATIC_CASES[case]
    ids = random_prompt(PROMPT_LENGTH)
    expected = target.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS)
    out, accepted = _speculate(target, drafter, ids, implementation, {**cache_config, "static": True})
    _, dynamic_accepted = _speculate(target, dynamic_drafter, ids, implementation, cache_config)
    assert torch.equal(out, expected), f"first diff at {(out != expected).nonzero()[:1].tolist()}"
    assert accepted == dynamic_accepted  # the static draft proposed exactly the dynamic draft's tokens
    assert 0 < sum(accepted) < 3 * len(accepted)  # some drafts accepted, some rejected: the check can fail


@pytest.mark.parametrize(
    "where", [pytest.param("drafter", marks=needs_traceable_transformers), "auto", "disabled"]
)
def test_static_draft_step_compiles_once_when_asked(where, fresh_dynamo):
    """A `compile_config` on the drafter's generation config compiles the static draft's one-token step, CPU
    included: one graph for a whole speculative generation (contexts grow, the ring wraps, rounds roll back), the
    output is still the target's and every draft is the eager draft's. On CPU without one (`auto`: transformers
    compiles only on accelerators) or with `generate(..., disable_compile=True)`, nothing is compiled."""
    target, drafter = model_pair("llama", "budgetdraft_varlen", num_assistant_tokens=3)
    backend, graphs = graph_counter()
    kwargs = {"disable_compile": True} if where == "disabled" else {}
    if where != "auto":
        drafter.generation_config.compile_config = CompileConfig(fullgraph=True, backend=backend, mode=None)
    ids = random_prompt(PROMPT_LENGTH, seed=1)
    implementation, cache_config = STATIC_CASES["budgeted-chunk"]
    cache_config = {**cache_config, "static": True}
    out, accepted = _speculate(target, drafter, ids, implementation, cache_config, **kwargs)
    assert torch.equal(out, target.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS))
    assert len(graphs) == (1 if where == "drafter" else 0)
    drafter.generation_config.compile_config = None
    _, eager_accepted = _speculate(target, drafter, ids, implementation, cache_config)
    assert accepted == eager_accepted and len(eager_accepted) > 5


# ---------------------------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------------------------


def test_static_needs_varlen_attention_at_construction_but_generate_sets_it():
    """Built by hand, a static cache refuses a drafter on stock attention; through `generate()` the call switches
    the drafter to `budgetdraft_varlen` for the call and restores its attention after."""
    target, drafter = model_pair("llama", "sdpa")
    with pytest.raises(ValueError, match="attn_implementation='budgetdraft_varlen'"):
        SinkWindowCache(drafter.config, num_sink_tokens=4, window_length=8, static=True)
    ids = random_prompt(40)
    out = target.generate(
        ids,
        assistant_model=drafter,
        do_sample=False,
        max_new_tokens=6,
        cache_implementation="budgeted",
        cache_config={"budget": 16, "policy": "streaming", "static": True},
    )
    assert torch.equal(out, target.generate(ids, do_sample=False, max_new_tokens=6))
    assert drafter.config._attn_implementation == "sdpa" and target.config._attn_implementation == "sdpa"
    with pytest.raises(TypeError, match="static must be"):
        BudgetedCache(drafter.config, budget=16, static="yes")


def test_static_step_refuses_an_attention_that_ignored_its_slot_mask():
    _, drafter = model_pair("llama", "budgetdraft_varlen")
    cache = SinkWindowCache(drafter.config, num_sink_tokens=2, window_length=8, slack=4, static=True)
    ids = random_prompt(20)
    with torch.no_grad():
        drafter(ids[:, :10], cache=cache)
        drafter.set_attn_implementation("sdpa")  # switched after the cache was built
        drafter(ids[:, 10:11], cache=cache)  # this step read stale slots ...
        with pytest.raises(ValueError, match="never read by the attention function"):
            drafter(ids[:, 11:12], cache=cache)  # ... and the next one says so


def test_a_family_calling_update_without_its_kwargs_reads_its_slots():
    """GPT-NeoX's attention passes no kwargs to `cache.update`; the attention function finds the step's layer through
    the key buffer it is handed, so its steps (the ring wrapped) compute what the dynamic storage computes."""
    config = tiny_config("gpt_neox")
    model = AutoModelForCausalLM.from_config(config, attn_implementation="budgetdraft_varlen").eval()
    ids = random_prompt(60)
    logits = []
    for static in (False, True):
        cache = SinkWindowCache(model.config, num_sink_tokens=2, window_length=8, static=static)
        with torch.no_grad():
            model(ids[:, :40], cache=cache)
            logits.append(torch.cat([model(ids[:, i : i + 1], cache=cache).logits for i in range(40, 60)], 1))
    torch.testing.assert_close(logits[1], logits[0])


def test_query_scored_static_budget_needs_capture():
    _, drafter = model_pair("llama", "budgetdraft_varlen")
    ids = random_prompt(60)
    cache = BudgetedCache(
        drafter.config, budget=16, policy="snapkv", policy_kwargs={"window_size": 4}, static=True
    )
    with torch.no_grad():
        drafter(ids[:, :50], cache=cache)  # no capture: the policy never saw the queries
        with pytest.raises(ValueError, match="query_capture"):
            drafter(ids[:, 50:51], cache=cache)
    captured = BudgetedCache(
        drafter.config, budget=16, policy="snapkv", policy_kwargs={"window_size": 4}, static=True
    )
    with torch.no_grad(), query_capture(drafter):
        drafter(ids[:, :50], cache=captured)
    assert all(layer.num_kept == 16 for layer in captured.layers)


@pytest.mark.parametrize("static", [False, True])
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sink=st.integers(0, 5),
    window=st.integers(1, 12),
    skipped=st.integers(0, 30),
    extra=st.integers(0, 5),
    steps=st.lists(st.integers(1, SLACK), max_size=6),
    seed=st.integers(0, 2**16),
)
def test_skipping_what_the_window_drops_changes_nothing_a_query_reads(
    static, sink, window, skipped, extra, steps, seed
):
    """`skip`: a layer fed the sink, then `skip(n)`, then the last `window + extra` tokens shows every later query
    exactly what a layer fed the whole sequence shows (a position's keys depend only on its own inputs)."""
    layer_class = StaticDraftLayer if static else DraftLayer
    whole, skipping = (layer_class(SinkSelection(sink), window_length=window, slack=SLACK) for _ in range(2))
    generator = torch.Generator().manual_seed(seed)
    head = max(sink, 1)
    keys, values = random_kv(head + skipped + window + extra, generator)

    def feed(layer, k, v):
        attention_kwargs = {}
        out = layer.update(k, v, kwargs=attention_kwargs)
        if STATIC_LAYER_KWARG not in attention_kwargs:
            return out, None
        return out, layer.consume_key_mask()

    feed(whole, keys, values)
    feed(skipping, keys[:, :, :head], values[:, :, :head])
    skipping.skip(skipped)
    feed(skipping, keys[:, :, head + skipped :], values[:, :, head + skipped :])
    assert int(skipping.get_seq_length()) == int(whole.get_seq_length())
    for tokens in steps:
        new = random_kv(tokens, generator)
        shown = []  # per layer: for each new query, the keys and values it reads, in position order
        for layer in (whole, skipping):
            (k, v), mask = feed(layer, *new)
            past = k.shape[2] - tokens
            if mask is None:  # dynamic: [visible past, new], the new block causal
                shown.append([(k[:, :, : past + i + 1], v[:, :, : past + i + 1]) for i in range(tokens)])
            else:
                shown.append([_visible_in_position_order(layer, mask[:, :, i]) for i in range(tokens)])
        for (k_skip, v_skip), (k_whole, v_whole) in zip(shown[1], shown[0], strict=True):
            assert torch.equal(k_skip, k_whole) and torch.equal(v_skip, v_whole)


@pytest.mark.parametrize("layer_class", [DraftLayer, StaticDraftLayer])
def test_skip_errors_teach(layer_class):
    layer = layer_class(SinkSelection(4), window_length=8, slack=SLACK)
    with pytest.raises(ValueError, match="store the sink"):
        layer.skip(5)
    layer.update(*random_kv(3, torch.Generator().manual_seed(0)), kwargs={})
    with pytest.raises(ValueError, match="store the sink"):  # the sink is not full yet
        layer.skip(5)
    layer.update(*random_kv(9, torch.Generator().manual_seed(1)))
    layer.skip(20)
    with pytest.raises(ValueError, match="never stored"):
        layer.crop(-1)  # back before the skipped positions
    with pytest.raises(ValueError, match="count of positions"):
        layer.skip(-1)
    layer.reset()  # a reset cache starts over: crops are bounded by its own contents again
    layer.update(*random_kv(9, torch.Generator().manual_seed(2)))
    layer.crop(-3)
    assert int(layer.get_seq_length()) == 6
