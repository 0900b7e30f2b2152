"""Compiled forwards whose module guards are checked once per call (`generation/compiled_call.py`): dynamo's module
guards are dropped from whole-graph compilations, and each compiled function belongs to one model in one state, so
a model changed between calls, or another model of the same shapes, never runs a graph traced for something else."""

import copy

import pytest
import torch
from compile_counter import graph_counter
from test_device_round import speculate_compiled
from tiny_models import model_pair, random_prompt
from torch_support import needs_traceable_transformers
from transformers import CompileConfig

from hf_budgetdraft.attention.scoped import using_attention
from hf_budgetdraft.generation import compiled_call as compiled_call_module
from hf_budgetdraft.generation.compiled_call import (
    FUNCTIONS_KEPT,
    compiled_call,
    has_compiled_call,
    module_fingerprint,
    module_guards_dropped,
)

needs_guard_filter = pytest.mark.skipif(
    not hasattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe"),
    reason=f"torch {torch.__version__} has no guard filter: every guard is checked at every step",
)
WHOLE_GRAPH = dict(fullgraph=True, dynamic=False, mode=None)


def test_the_fingerprint_sees_what_a_trace_reads_besides_tensors():
    target, _ = model_pair("llama", "sdpa")
    first = module_fingerprint(target)
    assert module_fingerprint(target) == first  # stable: a call on an unchanged model reuses its graphs
    assert module_fingerprint(copy.deepcopy(target)) == first  # a copy is in the same state
    layer = target.model.layers[0]

    def differs(change, undo) -> bool:
        change()
        try:
            return module_fingerprint(target) != first
        finally:
            undo()
            assert module_fingerprint(target) == first

    scaling = layer.self_attn.scaling
    assert differs(
        lambda: setattr(layer.self_attn, "scaling", 2 * scaling),
        lambda: setattr(layer.self_attn, "scaling", scaling),
    )
    assert differs(target.train, target.eval)
    handles = []
    assert differs(
        lambda: handles.append(layer.register_forward_hook(lambda *args: None)),
        lambda: handles.pop().remove(),
    )
    assert differs(lambda: target.to(torch.bfloat16), target.float)
    forward = layer.mlp.forward
    assert differs(
        lambda: setattr(layer.mlp, "forward", lambda x: forward(x)), lambda: delattr(layer.mlp, "forward")
    )
    theta = target.config.rope_theta if hasattr(target.config, "rope_theta") else None
    if theta is not None:
        assert differs(
            lambda: setattr(target.config, "rope_theta", 2 * theta),
            lambda: setattr(target.config, "rope_theta", theta),
        )
    with using_attention(target, "eager"):  # a per-call scope is part of the state a trace reads
        assert module_fingerprint(target) != first
    assert module_fingerprint(target) == first


def test_compile_options_drop_module_guards_only_for_whole_graphs():
    whole = compiled_call_module._compile_options(CompileConfig(**WHOLE_GRAPH))
    broken = compiled_call_module._compile_options(CompileConfig(fullgraph=False, dynamic=False, mode=None))
    assert "options" not in broken or "guard_filter_fn" not in (broken["options"] or {})
    assert not module_guards_dropped(CompileConfig(fullgraph=False, mode=None))
    if not hasattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe"):
        assert not module_guards_dropped(CompileConfig(**WHOLE_GRAPH))
        return
    assert whole["options"]["guard_filter_fn"] is torch.compiler.skip_guard_on_all_nn_modules_unsafe
    # torch takes options only without a mode: an inductor mode becomes its options
    moded = compiled_call_module._compile_options(CompileConfig(fullgraph=True, mode="reduce-overhead"))
    assert moded.get("mode") is None and moded["options"]["triton.cudagraphs"] is True
    backend, _ = graph_counter()
    custom = compiled_call_module._compile_options(CompileConfig(fullgraph=True, backend=backend))
    assert custom["mode"] == "reduce-overhead" and not (custom.get("options") or {})


@needs_guard_filter
def test_a_whole_graph_forward_keeps_its_input_guards_and_drops_the_module_ones(monkeypatch, fresh_dynamo):
    target, _ = model_pair("llama", "sdpa")
    seen, drop = [], torch.compiler.skip_guard_on_all_nn_modules_unsafe

    def spy(entries):
        keep = drop(entries)
        seen.extend(zip(entries, keep, strict=True))
        return keep

    monkeypatch.setattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe", spy, raising=False)
    backend, graphs = graph_counter()
    fn, _ = compiled_call(target, CompileConfig(backend=backend, **WHOLE_GRAPH))
    with torch.no_grad():
        fn(target, input_ids=random_prompt(4), use_cache=False)
    kept = {entry.name for entry, keep in seen if keep}
    assert len(graphs) == 1 and len(kept) < len(seen) / 2  # most guards are on modules
    assert "kwargs['input_ids']" in kept and not any(name.startswith("model") for name in kept)


def _greedy(target, ids, new_tokens=24):
    return target.generate(ids, do_sample=False, max_new_tokens=new_tokens)


@needs_traceable_transformers
@pytest.mark.parametrize("change", ["attribute", "hook"])
def test_a_model_changed_between_calls_runs_a_graph_traced_for_its_new_state(change, fresh_dynamo):
    """The module guards that would have caught the change are not checked at each step; the fingerprint, read
    once per call, gives the changed model a graph of its own."""
    target, drafter = model_pair("llama", "sdpa", num_assistant_tokens=None)
    backend, graphs = graph_counter()
    ids = random_prompt(100, seed=5)
    out, stats = speculate_compiled(target, drafter, ids, backend, new_tokens=24)
    assert (
        torch.equal(out, _greedy(target, ids)) and stats.runtime["verify"]["compiled_calls"] == stats.rounds
    )
    before = len(graphs)
    attention = target.model.layers[0].self_attn
    if change == "attribute":
        attention.scaling *= 8
    else:
        attention.register_forward_hook(lambda module, args, out: (out[0] * 3, *out[1:]))
    expected = _greedy(target, ids)
    assert not torch.equal(expected, out)  # the change matters
    out, stats = speculate_compiled(target, drafter, ids, backend, new_tokens=24)
    assert torch.equal(out, expected) and len(graphs) > before
    assert stats.runtime["verify"]["module_guards_per_call"] == module_guards_dropped(
        CompileConfig(backend=backend, **WHOLE_GRAPH)
    )


@needs_traceable_transformers
def test_two_models_of_the_same_shapes_never_share_a_graph(fresh_dynamo):
    target, drafter = model_pair("llama", "sdpa", num_assistant_tokens=None)
    other = copy.deepcopy(target)
    other.model.layers[0].self_attn.scaling *= 8  # same tensors' shapes, another constant in the trace
    backend, _ = graph_counter()
    ids = random_prompt(100, seed=5)
    assert not torch.equal(_greedy(target, ids), _greedy(other, ids))
    for model in (target, other, target):
        out, stats = speculate_compiled(model, drafter, ids, backend, new_tokens=24)
        verify = stats.runtime["verify"]
        assert torch.equal(out, _greedy(model, ids))
        assert verify["failure"] is None and verify["compiled_calls"] == stats.rounds


def test_models_in_one_state_share_a_function_and_few_are_kept(fresh_dynamo):
    """A copy of a model (the same state) reuses its compiled function (its graphs read the weights they are given);
    a change makes a new one; the least recently used beyond `FUNCTIONS_KEPT` are dropped."""
    target, _ = model_pair("llama", "sdpa")
    config = CompileConfig(backend=graph_counter()[0], **WHOLE_GRAPH)
    first = compiled_call(target, config)[0]
    assert compiled_call(copy.deepcopy(target), config)[0] is first and has_compiled_call(target, config)
    functions = [first]
    for _ in range(FUNCTIONS_KEPT):
        target.model.layers[0].self_attn.scaling += 1.0
        functions.append(compiled_call(target, config)[0])
    assert len({id(fn) for fn in functions}) == len(functions)
    kept = {fn for fn, _ in compiled_call_module._functions.values()}
    assert first not in kept and set(functions[-FUNCTIONS_KEPT:]) <= kept


@needs_traceable_transformers
def test_graphs_run_without_their_cuda_graphs_are_recorded(fresh_dynamo):
    """Inductor counts a graph compiled for CUDA graphs that runs without them (launched kernel by kernel,
    host-bound on a GPU); both steps record the graphs they compiled so."""

    def skipping_backend(graph_module, example_inputs):
        torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] += 1  # what inductor does on a skip
        return graph_module.forward

    target, drafter = model_pair("llama", "sdpa", num_assistant_tokens=None)
    drafter.generation_config.compile_config = CompileConfig(backend=skipping_backend, **WHOLE_GRAPH)
    out, stats = speculate_compiled(target, drafter, random_prompt(100, seed=7), skipping_backend)
    verify, draft = stats.runtime["verify"], stats.runtime["draft_step"]
    assert verify["cuda_graph_skips"] == verify["graphs_compiled"] == verify["new_shapes"] > 0
    assert draft["cuda_graph_skips"] == draft["graphs_compiled"] == 1
    _, stats = speculate_compiled(target, drafter, random_prompt(100, seed=7), skipping_backend)
    assert stats.runtime["verify"]["cuda_graph_skips"] == stats.runtime["draft_step"]["cuda_graph_skips"] == 0
