"""The device round (`generation/device_loop.py`, `generation/static_verify.py`) on CPU: the target on a static cache,
verification padded to buckets and compiled (eager or counting backends here), acceptance on the device, one host
read a round. Greedy output is the target's own on the test families; graphs compile once per shape and process;
a failed compilation falls back losslessly without poisoning later compilations."""

import contextlib
import copy
import threading

import pytest
import torch
from compile_counter import graph_counter
from resolved_plans import cuda_rules_on_cpu, plan_for
from test_device_rules import HostReads
from tiny_families import family_pair, kv_sharing_model
from tiny_models import FAMILIES, model_pair, random_prompt, skip_unless_known, supports
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch_support import needs_traceable_transformers
from transformers import CompileConfig, DynamicCache, GenerationConfig

from hf_budgetdraft import record_speculation
from hf_budgetdraft.attention.scoped import using_attention
from hf_budgetdraft.cache import is_full_attention_only
from hf_budgetdraft.cache.ring_sliding_layer import RingSlidingLayer
from hf_budgetdraft.compat import cache_kwargs
from hf_budgetdraft.generation.device_loop import DeviceRound, unsupported
from hf_budgetdraft.generation.device_rules import device_rules
from hf_budgetdraft.generation.draft_steps import DraftSteps
from hf_budgetdraft.generation.model_state import model_state
from hf_budgetdraft.generation.static_verify import StaticVerify, bucket_of, buckets, ring_slack, take_cache

ROUND = {"device_round": True}
SIZES = {
    "budgeted": {"budget": 32, "window_length": 16},
    "sink_window": {"num_sink_tokens": 4, "window_length": 40},
}
FULL_ATTENTION = [f for f in FAMILIES if f not in ("gemma2",)]
TIMEOUT = 120  # seconds a held call or compilation waits before failing the test instead of hanging it


def failing_backend(graph_module, example_inputs):
    raise RuntimeError("forced compile failure")


def speculate(target, drafter, ids, cache="budgeted", cache_config=None, **kwargs):
    kwargs = {"do_sample": False, "max_new_tokens": 40, **kwargs}
    with record_speculation() as stats:
        out = target.generate(
            ids,
            assistant_model=drafter,
            cache_implementation=cache,
            cache_config={**SIZES[cache], **ROUND, **(cache_config or {})},
            **kwargs,
        )
    return out, stats


def speculate_compiled(target, drafter, ids, backend, new_tokens: int = 30, **kwargs):
    """`speculate` with the verification compiled by `backend`, draft length 3 unless `cache_config` says."""
    config = CompileConfig(fullgraph=True, dynamic=False, backend=backend, mode=None)
    cache_config = {"draft_length": 3, "compile_verify": True, **kwargs.pop("cache_config", {})}
    return speculate(
        target,
        drafter,
        ids,
        cache_config=cache_config,
        compile_config=config,
        max_new_tokens=new_tokens,
        **kwargs,
    )


def test_buckets_cover_every_length_with_few_shapes():
    assert buckets(17) == (1, 2, 4, 8, 16, 17) and buckets(1) == (1,) and buckets(8) == (1, 2, 4, 8)
    assert buckets(17, coarse=True) == (1, 17) and buckets(1, coarse=True) == (1,)
    assert [bucket_of(n, buckets(17)) for n in (1, 2, 3, 5, 9, 16, 17)] == [1, 2, 4, 8, 16, 16, 17]
    with pytest.raises(ValueError, match="exceeds"):
        bucket_of(18, buckets(17))


def test_the_device_round_is_a_device_rule():
    assert not device_rules("cpu").device_round and device_rules("cuda").device_round
    assert not device_rules("mps").device_round
    target, drafter = model_pair("llama", "sdpa", num_assistant_tokens=None)
    cpu = plan_for(target, drafter)
    assert cpu.device_round is False and cpu.verify_compile_config is None
    assert cpu.target_attention is not None  # the CPU round keeps its fast verification
    forced = plan_for(target, drafter, cache_config=ROUND)
    assert forced.device_round and forced.verify_compile_config is None and forced.target_attention is None
    asked = plan_for(target, drafter, cache_config={**ROUND, "compile_verify": True})
    assert asked.verify_compile_config.dynamic is False and asked.reasons["compile_verify"] == "cache_config"
    off = plan_for(target, drafter, cache_config={**ROUND, "compile_verify": True}, disable_compile=True)
    assert (
        off.verify_compile_config is None
        and off.reasons["compile_verify"] == "generate(disable_compile=True)"
    )
    with pytest.raises(ValueError, match="set device_round=True"):
        plan_for(target, drafter, cache_config={"compile_verify": True})


def test_the_verification_buckets_are_the_targets_device_rule():
    """CPU pads a verification to at most twice its length; CUDA's rules verify in two buckets, 1 and the call's
    longest round (each a CUDA-graph capture of the whole target)."""
    target, drafter = model_pair("llama", "sdpa", num_assistant_tokens=None)
    assert plan_for(target, drafter, cache_config=ROUND).coarse_verify_buckets is False
    assert plan_for(target, drafter).reasons["coarse_verify_buckets"] == "transformers' loop verifies"
    ids = random_prompt(120, seed=3)
    expected = target.generate(ids, do_sample=False, max_new_tokens=40)
    used = {}
    for device, rules in (("cpu", contextlib.nullcontext), ("cuda", cuda_rules_on_cpu)):
        with rules():  # adaptive draft lengths: rounds of several lengths, the longest 9 tokens
            out, stats = speculate(
                target, drafter, ids, cache_config={"max_draft_length": 8, "compile_verify": False}
            )
        assert torch.equal(out, expected) and stats.runtime["loop"] == "device_round"
        assert stats.plan.coarse_verify_buckets == (device == "cuda")
        used[device] = set(stats.runtime["verify"]["buckets"])
    assert 9 in used["cuda"] <= {1, 9} and used["cpu"] <= {1, 2, 4, 8, 9}
    assert used["cpu"] & {2, 4, 8}  # rounds CUDA pads to 9


@pytest.mark.parametrize("cache", ["budgeted", "sink_window"])
@pytest.mark.parametrize("family", FULL_ATTENTION)
def test_greedy_output_is_the_targets_own(family, cache):
    skip_unless_known(family)
    if not supports(family, "sdpa"):
        pytest.skip("no sdpa")
    target, drafter = model_pair(family, "sdpa", num_assistant_tokens=None)
    assert is_full_attention_only(target.config)
    ids = random_prompt(120, seed=2)
    expected = target.generate(ids, do_sample=False, max_new_tokens=40)
    out, stats = speculate(target, drafter, ids, cache, {"draft_length": 3})
    assert torch.equal(out, expected)
    assert stats.runtime["loop"] == "device_round" and stats.rounds > 5
    assert (
        0 < sum(stats.accepted_per_round) < sum(stats.proposed_per_round)
    )  # full, partial and no acceptance


def test_the_prefill_computes_the_last_positions_logits_only():
    """A prompt's `(P, V)` logits would dwarf its cache on a long prompt: each prefill chunk asks for one position,
    each verification for all of its tokens."""
    target, drafter = model_pair("llama", "sdpa", num_assistant_tokens=None)
    kept = []
    hook = target.register_forward_pre_hook(
        lambda module, args, kwargs: kept.append(kwargs.get("logits_to_keep")), with_kwargs=True
    )
    try:
        out, stats = speculate(target, drafter, random_prompt(150, seed=2), prefill_chunk_size=64)
    finally:
        hook.remove()
    assert stats.runtime["loop"] == "device_round"
    assert kept[:3] == [1, 1, 1] and set(kept[3:]) == {None}  # 150 tokens in chunks of 64, then the rounds


@pytest.mark.parametrize("family", ["lfm2", "gemma3", "cohere2"])
def test_a_drafter_with_transformers_own_layers_rolls_back_in_the_device_round(family):
    """Sliding windows and convolution states (transformers' layers) roll back from their recorded past: the device
    round records it, as transformers' loop does (without, the first rollback raised), and drops the prompt's
    past after the drafter's prefill."""
    target, _ = model_pair("llama", "sdpa", num_assistant_tokens=None)
    _, drafter = family_pair(family)
    ids = random_prompt(200, seed=2)
    expected = target.generate(ids, do_sample=False, max_new_tokens=30)
    out, stats = speculate(target, drafter, ids, "sink_window", {"draft_length": 4}, max_new_tokens=30)
    assert torch.equal(out, expected) and stats.runtime["loop"] == "device_round"
    assert stats.rounds > 5 and sum(stats.proposed_per_round) > sum(stats.accepted_per_round)


@needs_traceable_transformers
@pytest.mark.parametrize("family", FULL_ATTENTION)
def test_the_compiled_round_is_the_targets_own(family, fresh_dynamo):
    """The verification and the draft step traced by dynamo on CUDA's whole-graph setting (counting backends run
    each graph eagerly): one graph per bucket and one draft step graph, none compiled again, the output the
    target's own."""
    skip_unless_known(family)
    target, drafter = model_pair(family, "sdpa", num_assistant_tokens=None)
    backend, graphs = graph_counter()
    draft_backend, draft_graphs = graph_counter()
    drafter.generation_config.compile_config = CompileConfig(
        backend=draft_backend, fullgraph=True, dynamic=False, mode=None
    )
    ids = random_prompt(120, seed=3)
    expected = target.generate(ids, do_sample=False, max_new_tokens=30)
    out, stats = speculate_compiled(target, drafter, ids, backend, cache_config={"lean_step": False})
    verify, draft = stats.runtime["verify"], stats.runtime["draft_step"]
    assert torch.equal(out, expected)
    assert (
        verify["failure"] is None and verify["compiled_calls"] == stats.rounds and verify["eager_calls"] == 0
    )
    assert len(graphs) == verify["new_shapes"] == 3 and verify["recompiles"] == 0  # buckets 1, 2, 4
    assert stats.plan.spec.static and len(draft_graphs) == draft["graphs_compiled"] == 1
    assert draft["recompiles"] == draft["eager_calls"] == 0


@needs_traceable_transformers
def test_the_compiled_draft_step_compiles_once_across_rounds(fresh_dynamo):
    """A round's first feed is a slice of the round's token buffer, copied with its own layout: a (1, 1) slice keeps
    the buffer's row stride, which the compiled step took for a new input and compiled again at the next round. The
    same for CUDA's catch-up after a fully accepted round, which feeds its tokens one at a time."""
    target, drafter = model_pair("llama", "sdpa", num_assistant_tokens=None)
    backend, graphs = graph_counter()
    drafter.generation_config.compile_config = CompileConfig(
        backend=backend, fullgraph=True, dynamic=False, mode=None
    )
    ids = random_prompt(120, seed=3)
    expected = target.generate(ids, do_sample=False, max_new_tokens=40)
    with cuda_rules_on_cpu():  # (the catch-up a token at a time is CUDA's rule)
        out, stats = speculate(
            target,
            drafter,
            ids,
            cache_config={"draft_length": 3, "lean_step": False, "compile_verify": False},
        )
    assert stats.plan.compiled_catch_up > 0
    record = stats.runtime["draft_step"]
    assert torch.equal(out, expected) and stats.runtime["loop"] == "device_round"
    assert 0 < sum(stats.accepted_per_round) < sum(stats.proposed_per_round)  # rounds of every kind
    assert record["graphs_compiled"] == len(graphs) == 1 and record["recompiles"] == 0
    assert record["eager_calls"] == 0 and record["compiled_calls"] > stats.rounds


@needs_traceable_transformers
@pytest.mark.parametrize("cache", ["budgeted", "sink_window"])
def test_the_compiled_draft_step_compiles_once_across_prompt_lengths(cache, fresh_dynamo):
    """The static draft cache's step reads whether the prompt was prefilled, not its length: a guard on the length
    compiled the step again for every prompt length, until dynamo's recompile limit stopped it."""
    target, drafter = model_pair("llama", "sdpa", num_assistant_tokens=None)
    backend, graphs = graph_counter()
    drafter.generation_config.compile_config = CompileConfig(
        backend=backend, fullgraph=True, dynamic=False, mode=None
    )
    records = []
    for length in (120, 151, 187):
        ids = random_prompt(length, seed=length)
        expected = target.generate(ids, do_sample=False, max_new_tokens=20)
        config = {"draft_length": 3, "lean_step": False, "compile_verify": False}
        out, stats = speculate(target, drafter, ids, cache, cache_config=config, max_new_tokens=20)
        assert torch.equal(out, expected) and stats.runtime["loop"] == "device_round"
        records.append(stats.runtime["draft_step"])
    assert len(graphs) == 1 and [r["graphs_compiled"] for r in records] == [1, 0, 0]
    assert all(r["compiled_calls"] > 0 and r["eager_calls"] == r["recompiles"] == 0 for r in records)


@needs_traceable_transformers
def test_every_cache_size_verifies_compiled_within_the_recompile_limit(fresh_dynamo, monkeypatch):
    """Each static cache size verifies through a compiled function of its own: with one function for every size,
    dynamo's recompile limit (per code object) left every size past the first few verifying eagerly."""
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 3)  # two buckets a size under CUDA's rules
    target, drafter = model_pair("llama", "sdpa", num_assistant_tokens=None)
    backend, graphs = graph_counter()
    sizes = set()
    with cuda_rules_on_cpu():
        for length in (100, 400, 700):  # three cache sizes (multiples of 256 positions)
            ids = random_prompt(length, seed=length)
            expected = target.generate(ids, do_sample=False, max_new_tokens=10)
            config = {"draft_length": 3, "compile": False}
            out, stats = speculate_compiled(target, drafter, ids, backend, 10, cache_config=config)
            verify = stats.runtime["verify"]
            assert torch.equal(out, expected)
            assert verify["failure"] is None and verify["eager_calls"] == 0 and verify["new_shapes"] == 2
            sizes.add(stats.candidate_generator.verify.cache_shape)
    assert len(sizes) == 3 and len(graphs) == 6


class _PausedStream:
    """A streamer that holds its call at its second `put` until `go` is set, and counts its puts."""

    def __init__(self, go: threading.Event):
        self.go, self.paused, self.puts = go, threading.Event(), 0

    def put(self, value):
        self.puts += 1
        if self.puts == 2:
            self.paused.set()
            assert self.go.wait(TIMEOUT), "the test never let this call go on"

    def end(self):
        pass


@needs_traceable_transformers
@pytest.mark.parametrize("stepping", ["compiled", "eager"])
def test_a_compilation_holds_off_another_calls_forwards(stepping, fresh_dynamo):
    """Two calls on shared models: while one compiles its verification (a backend held mid-compilation), the other
    runs no forward, compiled or eager; afterwards neither counts the other's graphs: no compilation failed, none
    recompiled, each output the target's own. Run together, the compilation failed in dynamo's guard building
    (the other call's forward reset transformers' output collector under the trace), and a compiled call took the
    other's graphs for recompilations of its own step and drafted eagerly from then on."""
    target, drafter = model_pair("llama", "sdpa", num_assistant_tokens=None)
    draft_backend, _ = graph_counter()
    drafter.generation_config.compile_config = CompileConfig(
        backend=draft_backend, fullgraph=True, dynamic=False, mode=None
    )
    config = {"draft_length": 3, "lean_step": False}
    eager = {"compile": False, "compile_verify": False} if stepping == "eager" else {}
    stepping_ids, compiling_ids = random_prompt(120, seed=1), random_prompt(150, seed=2)
    expected = {
        "stepping": target.generate(stepping_ids, do_sample=False, max_new_tokens=60),
        "compiling": target.generate(compiling_ids, do_sample=False, max_new_tokens=20),
    }
    warm_backend, _ = graph_counter()
    speculate_compiled(
        target, drafter, stepping_ids, warm_backend, 60, cache_config=config
    )  # compiles its shapes
    compiling, go = threading.Event(), threading.Event()

    def held_backend(graph_module, example_inputs):
        compiling.set()
        assert go.wait(TIMEOUT), "the test never let the compilation end"
        return graph_module.forward

    stream, results = _PausedStream(compiling), {}

    def run(name, ids, backend, new_tokens, cache_config, **kwargs):
        results[name] = speculate_compiled(
            target, drafter, ids, backend, new_tokens, cache_config=cache_config, **kwargs
        )

    stepping_call = threading.Thread(
        target=run,
        args=("stepping", stepping_ids, warm_backend, 60, {**config, **eager}),
        kwargs={"streamer": stream},
        daemon=True,
    )
    stepping_call.start()
    assert stream.paused.wait(TIMEOUT)
    other = threading.Thread(
        target=run, args=("compiling", compiling_ids, held_backend, 20, config), daemon=True
    )
    other.start()
    assert compiling.wait(TIMEOUT)  # the other call is compiling; the stepping call goes on to its next round
    assert not go.wait(0.5)  # time for the stepping call to (wrongly) run forwards while the other compiles
    assert stream.puts == 2 and stepping_call.is_alive()
    go.set()
    for thread in (stepping_call, other):
        thread.join(TIMEOUT)
    for name, (out, stats) in results.items():
        verify, draft = stats.runtime["verify"], stats.runtime["draft_step"]
        assert torch.equal(out, expected[name]), name
        assert verify["failure"] is draft["failure"] is None, name
        assert verify["recompiles"] == draft["recompiles"] == draft["eager_calls"] == 0, name
    verify, draft = results["stepping"][1].runtime["verify"], results["stepping"][1].runtime["draft_step"]
    assert verify["compiled"] is draft["compiled"] is (stepping == "compiled")
    assert verify["new_shapes"] == 0 and (verify["eager_calls"] == 0) is (stepping == "compiled")


def test_a_confidence_threshold_keeps_transformers_loop():
    """The device round drafts without reading the device; a threshold that ends a draft early needs a read a step,
    so such a call runs transformers' loop (asked explicitly, it is refused)."""
    target, drafter = model_pair("llama", "sdpa", num_assistant_tokens=None)
    plan = plan_for(target, drafter, assistant_confidence_threshold=0.3)
    assert plan.confidence_threshold == 0.3
    assert "confidence threshold" in plan.reasons["device_round"] and not plan.device_round
    with pytest.raises(ValueError, match="confidence threshold"):
        plan_for(target, drafter, cache_config=ROUND, assistant_confidence_threshold=0.3)


def _sliding_pair(family: str):
    if family in ("gemma4_text", "gemma3n_text"):  # their last layers reuse the keys of earlier ones
        target = kv_sharing_model(family)
        return target, copy.deepcopy(target)
    target, drafter = family_pair(family, num_assistant_tokens=None)
    if family == "mistral-all-sliding":  # a copy of itself on its own cache would never be rejected
        drafter = model_pair("llama", "sdpa", num_assistant_tokens=None)[1]
    return target, drafter


def _ring_layers(target) -> list:
    return [
        layer
        for caches in model_state(target).free_caches.values()
        for cache in caches
        for layer in cache.layers
        if isinstance(layer, RingSlidingLayer)
    ]


SLIDING_TARGETS = ["gemma2", "gemma3", "cohere2", "gpt_oss", "olmo3", "mistral-all-sliding", "gemma4_text"]


@pytest.mark.parametrize("family", [*SLIDING_TARGETS, "gemma3n_text"])
def test_a_target_with_sliding_layers_verifies_on_rings(family):
    """A target's sliding layers verify on rollback rings (transformers' static sliding layer shifts its oldest
    positions out and cannot take a rejected draft back): the output is the target's own, with rejections."""
    target, drafter = _sliding_pair(family)
    ids = random_prompt(200, seed=3).clamp(min=3)  # (a pad id in the prompt makes transformers infer padding)
    expected = target.generate(ids, do_sample=False, max_new_tokens=40)
    out, stats = speculate(target, drafter, ids, "sink_window", {"draft_length": 4})
    assert torch.equal(out, expected) and stats.runtime["loop"] == "device_round"
    assert 0 < sum(stats.accepted_per_round) < sum(stats.proposed_per_round)
    assert _ring_layers(target)  # the 200-token prompt wraps each ring (its window is 24 or 32)


@needs_traceable_transformers
@pytest.mark.parametrize("family", ["gemma3", "gpt_oss", "gemma4_text"])
def test_a_compiled_verification_over_rings_compiles_once(family, fresh_dynamo):
    """The rings' steps have fixed shapes and device offsets: one graph per bucket, none in a second call."""
    target, drafter = _sliding_pair(family)
    backend, graphs = graph_counter()
    ids = random_prompt(200, seed=3).clamp(min=3)
    expected = target.generate(ids, do_sample=False, max_new_tokens=30)
    for call in range(2):
        out, stats = speculate_compiled(target, drafter, ids, backend, cache="sink_window")
        verify = stats.runtime["verify"]
        assert torch.equal(out, expected) and verify["failure"] is None and verify["eager_calls"] == 0
        assert verify["compiled_calls"] == stats.rounds and verify["recompiles"] == 0
        assert verify["new_shapes"] == (len(graphs) if call == 0 else 0)


def test_a_compiled_verification_is_keyed_by_its_rings_too():
    """A ring's size (its window and the call's slack) is a shape the compiled forward depends on, like the cache's
    size: a call with another slack is a new shape, not a recompilation."""
    target, _ = family_pair("gemma3")  # sliding_window 24
    shapes = {StaticVerify(target, take_cache(target, 300, slack), None, 4).cache_shape for slack in (64, 96)}
    assert shapes == {(512, 23 + 64), (512, 23 + 96)}
    llama, _ = model_pair("llama", "sdpa")
    assert StaticVerify(llama, take_cache(llama, 300, 64), None, 4).cache_shape == (512,)  # no rings


def test_targets_the_rings_cannot_serve_keep_transformers_loop():
    """Layers besides attention, a kernel that takes a window instead of a mask, a cache passed to the call."""
    target, drafter = family_pair("lfm2", num_assistant_tokens=None)
    with pytest.raises(ValueError, match=r"\['conv'\] layers"):
        plan_for(target, drafter, cache_config=ROUND)
    target, drafter = family_pair("gemma3", num_assistant_tokens=None)
    with using_attention(target, "flash_attention_2"):
        assert "takes a window instead of the mask" in plan_for(target, drafter).reasons["device_round"]
    given = DynamicCache(config=target.config)
    given._is_user_defined = True  # as transformers marks a cache its caller passed
    assert "sliding layers" in unsupported(target, GenerationConfig(), cache_kwargs(given), random_prompt(20))


@needs_traceable_transformers
def test_compiled_verification_captures_each_bucket_once_per_process(fresh_dynamo):
    """Across rounds and calls: one graph per (bucket, cache size), never a recompilation; a second call compiles
    nothing and reuses the static cache of the first."""
    target, drafter = model_pair("llama", "sdpa", num_assistant_tokens=None, draft_layers=1)
    backend, graphs = graph_counter()
    ids = random_prompt(150, seed=4)
    expected = target.generate(ids, do_sample=False, max_new_tokens=40)
    records = []
    for draft_length in (3, 3, 1):
        cache_config = {"draft_length": draft_length}
        out, stats = speculate_compiled(target, drafter, ids, backend, 40, cache_config=cache_config)
        assert torch.equal(out, expected)
        records.append(stats.runtime["verify"])
    first, second, third = records
    assert all(r["compiled"] and r["eager_calls"] == 0 and r["failure"] is None for r in records)
    assert all(r["recompiles"] == 0 and r["compiled_calls"] > 0 for r in records)
    assert first["new_shapes"] == len(first["buckets"]) == first["graphs_compiled"] >= 2
    assert second["new_shapes"] == second["graphs_compiled"] == 0  # the same call again compiles nothing
    used = set(first["buckets"]) | set(second["buckets"]) | set(third["buckets"])
    assert len(graphs) == len(used) == sum(r["new_shapes"] for r in records)
    # one static cache served every call (given back after each)
    free = [c for caches in model_state(target).free_caches.values() for c in caches]
    assert len(free) == 1


@needs_traceable_transformers
def test_a_failed_compilation_falls_back_once_and_does_not_poison_later_ones(fresh_dynamo, caplog):
    target, drafter = model_pair("llama", "sdpa", num_assistant_tokens=None, draft_layers=1)
    ids = random_prompt(150, seed=5)
    expected = target.generate(ids, do_sample=False, max_new_tokens=30)
    out, stats = speculate_compiled(target, drafter, ids, failing_backend)
    record = stats.runtime["verify"]
    assert torch.equal(out, expected)
    assert "forced compile failure" in record["failure"] and record["compiled_calls"] == 0
    assert record["eager_calls"] == stats.rounds
    # a later compilation in the same process, nothing reset in between, compiles and runs
    backend, graphs = graph_counter()
    out, stats = speculate_compiled(target, drafter, ids, backend)
    record = stats.runtime["verify"]
    assert torch.equal(out, expected) and record["failure"] is None
    assert record["compiled_calls"] == stats.rounds and graphs


@needs_traceable_transformers
def test_a_verification_that_cannot_compile_again_verifies_eagerly(fresh_dynamo, monkeypatch):
    """A compiled shape whose guards fail later and cannot compile again (dynamo's recompile limit under fullgraph
    raises before the graph runs) falls back to the eager forward, recorded, instead of failing the call."""
    target, drafter = model_pair("llama", "sdpa", num_assistant_tokens=None, draft_layers=1)
    backend, _ = graph_counter()
    ids = random_prompt(150, seed=5)
    expected = target.generate(ids, do_sample=False, max_new_tokens=30)
    counted, calls = StaticVerify._counted, []

    def guards_fail_after_the_capture(self, padded, start):
        calls.append(start)
        if len(calls) > len(self.sizes):
            raise torch._dynamo.exc.FailOnRecompileLimitHit("recompile limit reached with fullgraph=True")
        return counted(self, padded, start)

    monkeypatch.setattr(StaticVerify, "_counted", guards_fail_after_the_capture)
    out, stats = speculate_compiled(target, drafter, ids, backend)
    record = stats.runtime["verify"]
    assert torch.equal(out, expected) and "FailOnRecompileLimitHit" in record["failure"]
    assert record["compiled_calls"] == 0 and record["eager_calls"] == stats.rounds


@needs_traceable_transformers
def test_one_host_read_a_round(fresh_dynamo):
    """Counted over whole calls, transformers' code included: besides what a call reads once (generate()'s setup,
    the prefill's mask and EOS checks: the same for a short and a long call), one read a round (the accepted count
    and the EOS position, together)."""
    target, drafter = model_pair("llama", "sdpa", num_assistant_tokens=None, draft_layers=1)
    backend, _ = graph_counter()
    ids = random_prompt(150, seed=6)
    cuda_like = {"static": True, "lean_step": False}
    speculate_compiled(target, drafter, ids, backend, cache_config=cuda_like, eos_token_id=5)  # compiles
    per_call = []
    for new_tokens in (30, 60):
        with HostReads(package_only=False) as reads:
            out, stats = speculate_compiled(
                target, drafter, ids, backend, new_tokens, cache_config=cuda_like, eos_token_id=5
            )
        assert stats.runtime["verify"]["compiled_calls"] == stats.rounds > 5
        assert reads.sites.pop("device_loop.py:_round") == stats.rounds
        per_call.append(dict(reads.sites))
    assert per_call[0] == per_call[1] and per_call[0]["device_loop.py:_generate"] == 1, per_call


class AfterTheRead(TorchFunctionMode):
    """Records the tensors each torch call touches while `open`: from a round's read (the end of `_round`) to the
    next forward (a draft step, or the verification of a round that drafts nothing), the host's work that the device
    waits for on CUDA."""

    def __init__(self):
        super().__init__()
        self.open, self.touched, self.calls = False, set(), 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.open:
            self.calls += 1
            self.touched.update(id(a) for a in (*args, *(kwargs or {}).values()) if torch.is_tensor(a))
        return func(*args, **(kwargs or {}))


def test_the_targets_rollback_is_queued_before_the_rounds_read(monkeypatch):
    """The target's cache rolls back on the device before the round's one read, so after it the host touches only
    the draft's side before drafting again."""
    target, drafter = model_pair("llama", "sdpa", num_assistant_tokens=None, draft_layers=1)
    ids = random_prompt(150, seed=6)
    expected = target.generate(ids, do_sample=False, max_new_tokens=40)
    window = AfterTheRead()
    round_ = DeviceRound._round

    def closing(forward):
        def call(self, *args, **kwargs):
            window.open = False
            return forward(self, *args, **kwargs)

        return call

    def opening_round(self, *args, **kwargs):
        outcome = round_(self, *args, **kwargs)  # its last call is the read
        window.open = True
        return outcome

    monkeypatch.setattr(DraftSteps, "__call__", closing(DraftSteps.__call__))
    monkeypatch.setattr(StaticVerify, "__call__", closing(StaticVerify.__call__))
    monkeypatch.setattr(DeviceRound, "_round", opening_round)
    with window:
        out, stats = speculate(target, drafter, ids, cache_config={"draft_length": 3})
    assert torch.equal(out, expected) and stats.rounds > 5 and window.calls > 0
    (cache,) = [c for free in model_state(target).free_caches.values() for c in free]
    lengths = {id(layer.cumulative_length) for layer in cache.layers}
    stored = {id(t) for layer in cache.layers for t in (layer.keys, layer.values)}
    assert not window.touched & (lengths | stored)


class DispatchedOps(TorchDispatchMode):
    """The aten operations run inside the block (each a kernel launch on CUDA when eager)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@torch.no_grad()
def test_the_targets_rollback_is_one_operation_however_many_layers():
    """Outside the compiled graphs every operation is a launch the host pays for each round: the rollback of every
    layer's count is one fused subtraction (an 8B target has 32 layers)."""
    target, _ = model_pair("llama", "sdpa", num_assistant_tokens=None)
    cache = take_cache(target, 64, ring_slack(4))
    verify = StaticVerify(target, cache, None, 4)
    ids = random_prompt(20, seed=1)
    verify.prefill(ids)
    verify(ids[:, :4], 20)
    kept = torch.tensor(1)
    with DispatchedOps() as dispatched:
        verify.keep(kept)
    assert len(dispatched.ops) == 2 and dispatched.ops[-1].startswith("aten._foreach_add_")  # (back, then it)
    assert [int(layer.cumulative_length) for layer in cache.layers] == [22] * target.config.num_hidden_layers


def test_sampling_runs_on_the_device_and_top_k_1_is_greedy():
    target, drafter = model_pair("llama", "sdpa", num_assistant_tokens=None, draft_layers=1)
    ids = random_prompt(120, seed=7)
    expected = target.generate(ids, do_sample=False, max_new_tokens=30)
    out, stats = speculate(
        target, drafter, ids, cache_config={"draft_length": 3}, do_sample=True, top_k=1, max_new_tokens=30
    )
    assert torch.equal(out, expected) and stats.runtime["loop"] == "device_round"
    sampled = dict(cache_config={"draft_length": 3}, do_sample=True, temperature=1.5, max_new_tokens=30)
    first, again = [
        (torch.manual_seed(0), speculate(target, drafter, ids, **sampled))[1][0] for _ in range(2)
    ]
    assert torch.equal(first, again) and first.shape == (1, 150) and not torch.equal(first, expected)


def test_eos_min_new_tokens_and_a_streamer():
    target, drafter = model_pair("llama", "sdpa", num_assistant_tokens=None, draft_layers=1)
    ids = random_prompt(120, seed=8)
    reference = target.generate(ids, do_sample=False, max_new_tokens=40)[0, 120:]
    eos = int(reference[10])  # a token the target emits mid-way
    for kwargs in ({"eos_token_id": eos}, {"eos_token_id": eos, "min_new_tokens": 12}):
        expected = target.generate(ids, do_sample=False, max_new_tokens=40, **kwargs)
        out, stats = speculate(target, drafter, ids, cache_config={"draft_length": 4}, **kwargs)
        assert torch.equal(out, expected) and stats.runtime["loop"] == "device_round"
    streamed = []

    class Collect:
        def put(self, value):
            streamed.append(value.reshape(-1))

        def end(self):
            streamed.append(None)

    out, _ = speculate(target, drafter, ids, cache_config={"draft_length": 4}, streamer=Collect())
    assert streamed[-1] is None and torch.equal(torch.cat(streamed[:-1]), out[0])


def test_what_the_round_does_not_do_runs_transformers_loop():
    target, drafter = model_pair("llama", "sdpa", num_assistant_tokens=None, draft_layers=1)
    ids = random_prompt(120, seed=9)
    kwargs = {"repetition_penalty": 1.3}
    expected = target.generate(ids, do_sample=False, max_new_tokens=30, **kwargs)
    with record_speculation() as stats:
        out = target.generate(
            ids,
            assistant_model=drafter,
            cache_implementation="budgeted",
            do_sample=False,
            max_new_tokens=30,
            cache_config=SIZES["budgeted"],
            **kwargs,
        )
    assert torch.equal(out, expected) and stats.runtime["loop"] == "transformers"
    with pytest.raises(ValueError, match="RepetitionPenalty"):
        speculate(target, drafter, ids, max_new_tokens=30, **kwargs)


def test_calls_in_and_out_of_inference_mode_share_nothing_they_cannot():
    """A static cache filled under `torch.inference_mode()` holds inference tensors; a later call outside it gets
    a cache of its own instead of failing on an in-place update."""
    target, drafter = model_pair("llama", "sdpa", num_assistant_tokens=None, draft_layers=1)
    ids = random_prompt(100, seed=11)
    expected = target.generate(ids, do_sample=False, max_new_tokens=20)
    with torch.inference_mode():
        inside, _ = speculate(target, drafter, ids, max_new_tokens=20)
    outside, _ = speculate(target, drafter, ids, max_new_tokens=20)
    assert torch.equal(inside, expected) and torch.equal(outside, expected)


def test_a_dropped_model_takes_its_state_along(fresh_dynamo):
    """The per-model state (static caches, compiled verification, the draft step's rent) is keyed weakly: nothing
    it holds keeps the model alive."""
    import gc
    import weakref

    from hf_budgetdraft.generation.compiled_step import record_eager_steps

    target, drafter = model_pair("llama", "sdpa", num_assistant_tokens=None, draft_layers=1)
    speculate_compiled(target, drafter, random_prompt(80), graph_counter()[0])
    record_eager_steps(drafter, 1.0)
    assert (
        model_state(target).compiled and model_state(target).free_caches and model_state(drafter).rent == 1.0
    )
    alive = weakref.ref(target), weakref.ref(drafter)
    del target, drafter
    gc.collect()
    assert alive[0]() is None and alive[1]() is None
