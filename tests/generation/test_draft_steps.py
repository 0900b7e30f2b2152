"""The draft's step objects against the drafter's own forward: each writes the draft cache as that forward would and
returns its logits; `DraftSteps.for_plan` picks them from the plan once per call."""

import copy
import logging

import pytest
import torch
from compile_counter import graph_counter
from resolved_plans import cuda_rules_on_cpu, plan_for
from tiny_families import family_pair, kv_sharing_model
from tiny_models import model_pair, random_prompt, skip_unless_static
from torch_support import needs_traceable_transformers
from transformers import CompileConfig

from hf_budgetdraft import record_speculation
from hf_budgetdraft.attention.varlen import NAME as VARLEN
from hf_budgetdraft.generation import plan
from hf_budgetdraft.generation.draft_steps import (
    CheckedLeanStep,
    CompiledStep,
    DraftSteps,
    ForwardStep,
    Prefill,
)
from hf_budgetdraft.generation.spec import DraftSpec


def static_drafter_and_caches(count: int):
    _, drafter = model_pair("llama", "sdpa", num_assistant_tokens=None)
    drafter.set_attn_implementation(VARLEN)
    spec = DraftSpec(budget=24, window_length=16, slack=8)
    return drafter, [spec.build_cache(drafter.config, static=True) for _ in range(count)]


@pytest.mark.parametrize("kind", ["lean", pytest.param("compiled", marks=needs_traceable_transformers)])
@torch.no_grad()
def test_each_step_writes_and_returns_what_the_drafters_forward_does(kind, fresh_dynamo):
    drafter, (reference_cache, cache) = static_drafter_and_caches(2)
    prompt = random_prompt(90, seed=3)
    reference = ForwardStep(drafter, reference_cache)
    eager = ForwardStep(drafter, cache)
    if kind == "lean":
        step = CheckedLeanStep(drafter, cache, slack=8, fallback=eager)
    else:
        step = CompiledStep(
            drafter, cache, CompileConfig(fullgraph=True, dynamic=False, backend="eager"), eager
        )
    positions = torch.arange(90)[None]
    for prefill in (Prefill(reference, None, 4, False), Prefill(eager, None, 4, False)):
        prefill(prompt, positions)
    past = 90
    for feed in ([5], [6, 7, 8], [9], [10]):
        if kind == "compiled" and len(feed) > 1:
            continue  # a compiled step is one token
        ids, at = torch.tensor([feed]), torch.arange(past, past + len(feed))[None]
        expected = reference(ids, at)
        torch.testing.assert_close(step(ids, at), expected, rtol=1e-4, atol=1e-4)
        past += len(feed)
    assert not step.failed and step.checked
    for ours, theirs in zip(cache.layers, reference_cache.layers, strict=True):
        assert int(ours.length) == int(theirs.length) == past
        torch.testing.assert_close(ours.keys, theirs.keys, rtol=1e-5, atol=1e-5)


def test_a_plan_picks_its_steps_once():
    target, drafter = model_pair("llama", "sdpa", num_assistant_tokens=None)
    plan = plan_for(target, drafter, cache_config={"compile": True})
    with plan.drafting(drafter)():  # the call runs the drafter on budgetdraft_varlen
        cache = plan.spec.build_cache(drafter.config, static=True)
    steps = DraftSteps.for_plan(plan, drafter, cache)
    assert isinstance(steps.token, CompiledStep) and isinstance(steps.block, CheckedLeanStep)
    assert steps.token.fallback is steps.block and steps.block.fallback is steps.eager and steps.compiled
    plain = plan_for(target, drafter, cache_config={"compile": False, "lean_step": False})
    steps = DraftSteps.for_plan(plain, drafter, cache)
    assert steps.token is steps.block is steps.eager and not steps.compiled
    assert steps.prefill.window == plain.spec.prefill_window


@needs_traceable_transformers
@torch.no_grad()
def test_a_short_block_goes_through_the_compiled_step_one_token_at_a_time(fresh_dynamo):
    """With `tokens_one_by_one` (CUDA's device rule), a catch-up block of a few tokens runs the compiled one-token
    step per token: the same cache writes and last logits as the block forward, no eager block, and no graph beyond
    the one-token step's (a (1, 1) slice of the block keeps its row stride, which compiled a second graph: the step
    then drafted eagerly for the rest of the call)."""
    drafter, (reference_cache, cache) = static_drafter_and_caches(2)
    prompt = random_prompt(90, seed=5)
    reference = ForwardStep(drafter, reference_cache)
    eager = ForwardStep(drafter, cache)
    config = CompileConfig(fullgraph=True, dynamic=False, backend="eager")
    steps = DraftSteps(
        prefill=Prefill(eager, None, 4, False),
        block=eager,
        token=CompiledStep(drafter, cache, config, eager),
        eager=eager,
        tokens_one_by_one=3,
    )
    Prefill(reference, None, 4, False)(prompt, torch.arange(90)[None])
    steps(prompt, 0, None)
    blocks = []
    original = eager.__call__
    steps.block = lambda feed, positions: blocks.append(feed.shape[1]) or original(feed, positions)
    reference(torch.tensor([[9]]), torch.tensor([[90]]))
    steps(torch.tensor([[9]]), 90, None)  # a one-token step first: its graph
    feed = torch.tensor([[5, 6, 7]])
    logits = steps(feed, 91, None)
    torch.testing.assert_close(logits, reference(feed, torch.arange(91, 94)[None]), rtol=1e-4, atol=1e-4)
    assert steps.token.compiled_calls == 4 and blocks == []
    assert steps.token.graphs_compiled == 1 and steps.token.recompiles == 0 and not steps.token.failed
    steps(torch.tensor([[1, 2, 3, 4]]), 94, None)  # longer than tokens_one_by_one: one block forward
    assert blocks == [4] and steps.token.compiled_calls == 4


def _fullgraph_counter():
    """CUDA's compile setting (one whole graph, fixed shapes) on a backend that counts graphs instead of compiling."""
    backend, graphs = graph_counter()
    return CompileConfig(backend=backend, fullgraph=True, dynamic=False, mode=None), graphs


def _speculate_compiled(family: str, config: CompileConfig, cache_config: dict, pair=None):
    target, drafter = pair or family_pair(family)
    drafter.generation_config.compile_config = config
    ids = random_prompt(240)
    expected = target.generate(ids, do_sample=False, max_new_tokens=24)
    with record_speculation() as stats:
        out = target.generate(
            ids, assistant_model=drafter, do_sample=False, max_new_tokens=24, cache_implementation="sink_window",
            cache_config={"num_sink_tokens": 4, "window_length": 32, "draft_length": 6, **cache_config},
        )  # fmt: skip
    assert torch.equal(out, expected)
    return stats


@needs_traceable_transformers
def test_a_compiled_step_records_its_graphs_and_a_second_call_compiles_none(fresh_dynamo):
    config, graphs = _fullgraph_counter()
    pair, cache_config = family_pair("llama"), {"compile": True, "lean_step": False}
    first, second = (_speculate_compiled("llama", config, cache_config, pair) for _ in range(2))
    first, second = first.runtime["draft_step"], second.runtime["draft_step"]
    assert first["graphs_compiled"] == len(graphs) == 1 and first["recompiles"] == 0
    assert second["graphs_compiled"] == second["recompiles"] == 0 and second["compiled_calls"] > 0
    assert first["failure"] is second["failure"] is None


@needs_traceable_transformers
def test_a_step_whose_inputs_change_shape_drafts_eagerly_after_its_first_recompilation(fresh_dynamo, caplog):
    """LFM2's convolution state, kept with its past for rollback, grows a token a step: each step of a whole-graph
    compile would recompile until dynamo's limit failed the call. Asked for anyway, the step stops at its first
    recompilation, records it and drafts on eagerly: the output is the target's own."""
    config, graphs = _fullgraph_counter()
    with caplog.at_level(logging.WARNING):
        record = _speculate_compiled("lfm2", config, {"compile": True}).runtime["draft_step"]
    assert record["recompiles"] == 1 and record["graphs_compiled"] == len(graphs) == 2
    assert "recompiled" in record["failure"] and record["eager_calls"] > 0 and record["compiled_calls"] == 2
    assert "the compiled draft step recompiled" in caplog.text


def _plans_on_cpu_and_cuda(family: str):
    return _plans_on_cpu_and_cuda_of(*family_pair(family))


def _plans_on_cpu_and_cuda_of(target, drafter=None):
    drafter = drafter or copy.deepcopy(target)
    plan = plan_for(target, drafter, cache_config={"static": True})
    with cuda_rules_on_cpu():
        return plan, plan_for(target, drafter, cache_config={"static": True})


def test_the_plan_compiles_no_step_of_a_drafter_with_a_convolution_state():
    """LFM2's convolution layers keep transformers' cache, whose shape changes from step to step: not even CUDA's
    rule compiles its step from the first call."""
    for resolved in _plans_on_cpu_and_cuda("lfm2"):
        assert resolved.spec.compile is False and "besides attention" in resolved.reasons["compile"]


@needs_traceable_transformers
@pytest.mark.parametrize("family", ["gemma3", "cohere2", "mistral-all-sliding"])
def test_a_drafter_with_sliding_layers_compiles_one_graph_on_cudas_setting(fresh_dynamo, family):
    """On a static draft cache a drafter's own sliding layers are fixed-shape rings: CUDA's rule compiles the step
    from the first call, one whole graph a process, none in a later call, and the output is the target's own."""
    on_cpu, on_cuda = _plans_on_cpu_and_cuda(family)
    assert on_cuda.spec.compile is True  # on CPU the saving of compiling such a step was never measured:
    assert on_cpu.spec.compile is False and "no measured saving" in on_cpu.reasons["compile"]
    config, graphs = _fullgraph_counter()
    pair = family_pair(family)
    first, second = (_speculate_compiled(family, config, {"lean_step": False}, pair) for _ in range(2))
    assert first.plan.spec.static and first.plan.spec.compile
    first, second = first.runtime["draft_step"], second.runtime["draft_step"]
    assert first["graphs_compiled"] == len(graphs) == 1 and first["recompiles"] == 0
    assert second["graphs_compiled"] == second["recompiles"] == 0 and second["eager_calls"] == 0
    assert second["compiled_calls"] > 0 and first["failure"] is second["failure"] is None


@needs_traceable_transformers
def test_a_drafter_whose_layers_reuse_keys_compiles_one_graph_and_drafts_as_on_the_dynamic_storage(
    fresh_dynamo, monkeypatch
):
    """Gemma 4 past its KV-sharing point attends over an earlier layer's slot buffers and finds their slot mask
    through them: CUDA's whole-graph setting traces that in one graph, and each round drafts what the dynamic
    storage drafts (a window shorter than the prompt: the rings wrap). Where its attention copies the reused keys
    first (`.to(device)`, transformers 5.22), a traced step loses the buffer and drafts otherwise: there the plan
    keeps the step eager, says why, and refuses compile=True (the trace forced past it shows the difference)."""
    target = kv_sharing_model()
    skip_unless_static(target)
    problem = plan.compiled_step_problem(target)
    on_cuda = _plans_on_cpu_and_cuda_of(target)[1]
    assert on_cuda.spec.compile is (problem is None)  # CUDA compiles it from the first call where it can
    if problem:
        assert on_cuda.reasons["compile"] == problem and "copy of the keys it reuses" in problem
        with pytest.raises(ValueError, match="compile=True cannot hold"):
            plan_for(target, copy.deepcopy(target), cache_config={"static": True, "compile": True})
        monkeypatch.setattr(plan, "compiled_step_problem", lambda model: None)
    config, graphs = _fullgraph_counter()
    rounds = []
    for static, compile_config in ((False, None), (True, config)):
        drafter = copy.deepcopy(target)
        drafter.generation_config.compile_config = compile_config
        with record_speculation() as stats:
            target.generate(
                random_prompt(160, seed=1).clamp(min=3), assistant_model=drafter, do_sample=False,
                max_new_tokens=24, cache_implementation="sink_window",
                cache_config={"num_sink_tokens": 4, "window_length": 24, "draft_length": 4, "static": static},
            )  # fmt: skip
        rounds.append(stats.accepted_per_round)
    record = stats.runtime["draft_step"]
    assert (
        stats.plan.spec.compile
        and record["graphs_compiled"] == len(graphs) == 1
        and record["recompiles"] == 0
    )
    assert record["eager_calls"] == 0 and record["compiled_calls"] > 0
    assert (rounds[0] == rounds[1]) is (problem is None) and sum(rounds[1]) > 0
