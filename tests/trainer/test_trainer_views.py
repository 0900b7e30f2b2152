"""The training view IS the inference cache: for the same tokens, policy and budget, the drafter's continuation
logits from a BudgetDraft training view equal those produced token by token through the deployed cache."""

import pytest
import torch
from tiny_models import model_pair, random_prompt

from hf_budgetdraft import query_capture
from hf_budgetdraft.trainer import per_query_view
from hf_budgetdraft.trainer.views import SparseViewSpec, full_cache, run_shared_prefix, view_logits

pytestmark = pytest.mark.usefixtures("one_thread")

PREFIX, CONTINUATION = 80, 12
TOLERANCE = dict(
    rtol=1e-4, atol=1e-4
)  # fp32; block vs token-by-token attention differ by ~1e-5 on logits ~10

VIEWS = [  # (kind, policy, policy_kwargs, window_length, budgets)
    ("budgeted", "chunk", {"chunk_size": 4}, 16, [12, 24, 48]),
    ("budgeted", "streaming", {"num_sink_tokens": 4}, 16, [8, 24, 48]),
    ("budgeted", "snapkv", {"window_size": 4, "kernel_size": 3}, 16, [8, 24, 48]),
    ("budgeted", "chunk", {"chunk_size": 4, "query_proxy": "last_query"}, 16, [12, 24, 48]),
    ("budgeted", "chunk", {"chunk_size": 4}, 5, [12, 24, 48]),  # window < continuation: windowed block mask
    ("sink_window", "chunk", None, None, [8, 24, 48]),  # 4 sink + window of budget - 4: the window slides
    ("budgeted", "dynamic", {"chunk_size": 4}, 16, [12, 24, 48]),  # per-query view: each query its chunks
    ("budgeted", "dynamic", {"chunk_size": 4, "components": 2}, 5, [12, 24]),  # approximate scores, window 5
]


def _spec(kind, policy, kwargs, window):
    return SparseViewSpec(
        kind=kind, policy=policy, policy_kwargs=kwargs, window_length=window or 1, num_sink_tokens=4
    )


def _step_by_step(drafter, spec, budget, prefix, continuation):
    """What the deployed drafter computes: prefill the prompt into the cache, then one token per forward."""
    cache = spec.make_cache(drafter.config, budget)
    # the capture serves a query-scored prefill, or a dynamic policy's every step
    with torch.no_grad(), query_capture(drafter):
        drafter(prefix, cache=cache)
        steps = [
            drafter(continuation[:, t : t + 1], cache=cache).logits for t in range(continuation.shape[1])
        ]
    return torch.cat(steps, dim=1)  # (B, C, V)


def _case_id(case):
    kind, policy, kwargs, window, _ = case
    return f"{kind}-{policy}-{'-'.join(f'{v}' for v in (kwargs or {}).values())}-w{window}"


CASES = [(case, "sdpa") for case in VIEWS] + [(VIEWS[0], "eager"), (VIEWS[5], "eager"), (VIEWS[6], "eager")]


@pytest.mark.parametrize("case,attn", CASES, ids=[f"{_case_id(c)}-{a}" for c, a in CASES])
def test_view_equals_inference_cache(case, attn):
    kind, policy, kwargs, window, budgets = case
    _, drafter = model_pair("llama", attn)
    spec = _spec(kind, policy, kwargs, window)
    ids = random_prompt(PREFIX + CONTINUATION, seed=1)
    prefix, continuation = ids[:, :PREFIX], ids[:, PREFIX:]
    shared = run_shared_prefix(drafter, prefix, spec.query_window)
    with torch.no_grad():
        full = view_logits(drafter, continuation, full_cache(drafter.config, shared))
    views = {}
    for budget in budgets:  # every view shares the one prefix pass
        with torch.no_grad():
            views[budget] = view_logits(drafter, continuation, spec.build(drafter.config, shared, budget))
        torch.testing.assert_close(
            views[budget], _step_by_step(drafter, spec, budget, prefix, continuation), **TOLERANCE
        )
    # the oracle has power: a sparse view is far from the full cache and from another budget's view
    assert (views[budgets[0]] - full).abs().max() > 0.5
    assert (views[budgets[0]] - views[budgets[1]]).abs().max() > 0.5


def test_full_cache_branch_equals_plain_forward():
    _, drafter = model_pair("qwen3", "sdpa")
    ids = random_prompt(PREFIX + CONTINUATION, seed=2)
    shared = run_shared_prefix(drafter, ids[:, :PREFIX])
    with torch.no_grad():
        got = view_logits(drafter, ids[:, PREFIX:], full_cache(drafter.config, shared))
        expected = drafter(ids).logits[:, PREFIX:]
    torch.testing.assert_close(got, expected, **TOLERANCE)


@pytest.mark.parametrize("policy,kwargs", [("chunk", {"chunk_size": 4}), ("snapkv", {"window_size": 4})])
def test_view_equals_inference_cache_hybrid_sliding_model(policy, kwargs):
    # gemma2 mixes sliding-window layers (transformers' own cache layer) with full layers (the budgeted ones)
    _, drafter = model_pair("gemma2", "eager")
    spec = _spec("budgeted", policy, kwargs, 16)
    ids = random_prompt(PREFIX + CONTINUATION, seed=3)
    prefix, continuation = ids[:, :PREFIX], ids[:, PREFIX:]
    shared = run_shared_prefix(drafter, prefix, spec.query_window)
    with torch.no_grad():
        got = view_logits(drafter, continuation, spec.build(drafter.config, shared, 24))
    torch.testing.assert_close(got, _step_by_step(drafter, spec, 24, prefix, continuation), **TOLERANCE)
    # a sliding view on a model that has sliding layers of its own would need two custom masks: refused, not wrong
    narrow = _spec("budgeted", policy, kwargs, 4)
    with pytest.raises(ValueError, match="window_length >= continuation_length"):
        view_logits(drafter, continuation, narrow.build(drafter.config, shared, 24))


@pytest.mark.parametrize("window", [16, 4])
def test_per_query_view_on_a_hybrid_sliding_model(window):
    # the per-query view masks in the attention function: the sliding layers keep the model's own mask, so even a
    # window sliding during the continuation is exact
    _, drafter = model_pair("gemma2", "eager")
    spec = _spec("budgeted", "dynamic", {"chunk_size": 4}, window)
    ids = random_prompt(PREFIX + CONTINUATION, seed=3)
    prefix, continuation = ids[:, :PREFIX], ids[:, PREFIX:]
    shared = run_shared_prefix(drafter, prefix)
    with torch.no_grad():
        got = view_logits(drafter, continuation, spec.build(drafter.config, shared, 24))
    torch.testing.assert_close(got, _step_by_step(drafter, spec, 24, prefix, continuation), **TOLERANCE)


def test_per_query_view_scores_its_queries_in_bounded_blocks(monkeypatch):
    """A block of one query at a time (the memory bound at its tightest) gives the one-block view's logits."""
    _, drafter = model_pair("llama", "sdpa")
    spec = _spec(*VIEWS[6][:4])  # dynamic, approximate scores, window 5
    ids = random_prompt(PREFIX + CONTINUATION, seed=1)
    shared = run_shared_prefix(drafter, ids[:, :PREFIX], spec.query_window)
    logits = []
    for bound in (per_query_view.SELECTION_ELEMENTS, 1):
        monkeypatch.setattr(per_query_view, "SELECTION_ELEMENTS", bound)
        with torch.no_grad():
            logits.append(view_logits(drafter, ids[:, PREFIX:], spec.build(drafter.config, shared, 12)))
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=0)


def test_per_query_view_needs_an_attention_function_it_can_mask():
    _, drafter = model_pair("llama", "budgetdraft_sdpa")
    spec = _spec("budgeted", "dynamic", {"chunk_size": 4}, 16)
    ids = random_prompt(PREFIX + CONTINUATION, seed=3)
    view = spec.build(drafter.config, run_shared_prefix(drafter, ids[:, :PREFIX]), 24)
    with pytest.raises(ValueError, match="attn_implementation='sdpa' or 'eager'"):
        view_logits(drafter, ids[:, PREFIX:], view)


@pytest.mark.parametrize("policy", ["chunk", "dynamic"])
def test_batched_rows_select_per_row(policy):
    _, drafter = model_pair("llama", "sdpa")
    spec = _spec("budgeted", policy, {"chunk_size": 4}, 16)
    ids = torch.cat([random_prompt(PREFIX + CONTINUATION, seed=s) for s in (4, 5)])  # (2, P + C)
    shared = run_shared_prefix(drafter, ids[:, :PREFIX])
    with torch.no_grad():
        batched = view_logits(drafter, ids[:, PREFIX:], spec.build(drafter.config, shared, 24))
    for row in range(2):
        expected = _step_by_step(drafter, spec, 24, ids[row : row + 1, :PREFIX], ids[row : row + 1, PREFIX:])
        torch.testing.assert_close(batched[row : row + 1], expected, **TOLERANCE)


@pytest.mark.parametrize("policy,kwargs", [("snapkv", {"window_size": 4}), ("dynamic", {"chunk_size": 4})])
def test_gradients_flow_through_the_continuation_only_and_prefix_is_not_mutated(policy, kwargs):
    _, drafter = model_pair("llama", "sdpa")
    drafter.train()
    spec = _spec("budgeted", policy, kwargs, 16)
    ids = random_prompt(PREFIX + CONTINUATION, seed=6)
    shared = run_shared_prefix(drafter, ids[:, :PREFIX], spec.query_window)
    assert not any(k.requires_grad for k in shared.keys), "the shared prefix runs without gradient"
    before = [k.clone() for k in shared.keys]
    logits = view_logits(drafter, ids[:, PREFIX:], spec.build(drafter.config, shared, 24))
    logits = logits + view_logits(drafter, ids[:, PREFIX:], full_cache(drafter.config, shared))
    logits.logsumexp(-1).sum().backward()
    k_proj = drafter.model.layers[0].self_attn.k_proj.weight
    assert k_proj.grad is not None and k_proj.grad.abs().sum() > 0, (
        "keys of the continuation block get gradient"
    )
    for old, new in zip(before, shared.keys, strict=True):
        assert torch.equal(old, new), "building views must not mutate the shared prefix"
