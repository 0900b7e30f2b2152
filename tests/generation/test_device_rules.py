"""The plan knows its device: the device rules as pure functions, a plan made for a CUDA drafter, and a CUDA round
timed without a synchronisation of its own (CUDA faked on this CPU machine)."""

import collections
import os
import traceback

import pytest
import torch
from compile_counter import graph_counter
from resolved_plans import plan_for
from tiny_models import model_pair, random_prompt
from torch.overrides import TorchFunctionMode
from torch_support import needs_traceable_transformers
from transformers import CompileConfig

from hf_budgetdraft import record_speculation
from hf_budgetdraft.generation.device_rules import device_rules
from hf_budgetdraft.generation.draft_length import FixedDraftLength, RoundClock
from hf_budgetdraft.generation.draft_length import clock as clock_module

CPU_SPEEDUPS = ("lean_step", "few_row_linear", "prefill_window")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_keeps_its_speedups_and_rents_the_compilation(dtype):
    rules = device_rules("cpu", dtype)
    assert rules.lean_step and rules.prefill_window and not rules.compile_from_first_call
    assert rules.few_row_linear == (dtype == torch.float32)  # the few-row GEMMs are float32 kernels
    assert rules.round_clock == "host"
    assert set(rules.reasons) == {
        *CPU_SPEEDUPS,
        "compile_from_first_call",
        "device_round",
        "coarse_verify_buckets",
        "compiled_catch_up",
        "round_clock",
    }
    assert (
        not rules.device_round
        and not rules.coarse_verify_buckets
        and rules.reasons["device_round"].startswith("measured")
    )
    assert rules.reasons["compile_from_first_call"].startswith("measured")  # the rental's prices
    assert rules.compiled_catch_up == 0


@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_drops_the_cpu_speedups_compiles_at_once_and_times_with_events(device, dtype):
    rules = device_rules(device, dtype)
    assert not any(getattr(rules, name) for name in CPU_SPEEDUPS)
    assert rules.compile_from_first_call and rules.round_clock == "events" and rules.coarse_verify_buckets
    assert rules.reasons["compile_from_first_call"].startswith("measured")
    assert all(rules.reasons[name].startswith("estimate") for name in CPU_SPEEDUPS)


def test_other_accelerators_are_estimates():
    rules = device_rules("mps", torch.float16)
    assert not any(getattr(rules, name) for name in CPU_SPEEDUPS) and not rules.compile_from_first_call
    assert rules.reasons["compile_from_first_call"].startswith("estimate")


def test_a_plan_for_a_cuda_drafter_takes_the_cuda_rules(monkeypatch):
    target, drafter = model_pair("llama", "sdpa", num_assistant_tokens=None)
    cpu = plan_for(target, drafter)
    assert cpu.device_type == "cpu" and cpu.spec.lean_step and cpu.spec.prefill_window and cpu.target_linear
    assert cpu.spec.compile is False and "not yet" in cpu.reasons["compile"] and cpu.compiled_catch_up == 0
    # the models' weights stay on the CPU; only the device the plan reads is CUDA
    monkeypatch.setattr(type(drafter), "device", property(lambda self: torch.device("cuda")))
    plan = plan_for(target, drafter)
    assert plan.device_type == "cuda" and plan.spec.static
    assert plan.spec.lean_step is False and plan.spec.prefill_window is None and plan.target_linear is False
    assert plan.spec.compile is True and plan.reasons["compile"].startswith("measured")
    assert plan.compile_config.options == {"triton.cudagraphs": True, "graph_partition": False}
    assert plan.compile_config.fullgraph and plan.compile_config.dynamic is False
    assert set(plan.reasons) >= {
        "static",
        "lean_step",
        "compile",
        "prefill_window",
        "target_linear",
        "round_clock",
        "compiled_catch_up",
    }
    # a catch-up of a few tokens runs the compiled step a token at a time: only where the step compiles
    assert plan.compiled_catch_up == 4
    uncompiled = plan_for(target, drafter, disable_compile=True)
    assert uncompiled.spec.compile is False and uncompiled.compiled_catch_up == 0
    assert plan_for(target, drafter, cache_config={"lean_step": True}).spec.lean_step is True  # asked: kept


class FakeEvent:
    """A CUDA event on a fake clock: `record` stamps the clock's time."""

    clock = [0.0]

    def __init__(self, enable_timing=False):
        self.stamp = None

    def record(self):
        self.stamp = FakeEvent.clock[0]

    def query(self):
        return self.stamp is not None

    def synchronize(self):
        raise AssertionError("a recorded event was waited for")

    def elapsed_time(self, other):
        return (other.stamp - self.stamp) * 1e3


def test_a_cuda_round_adds_no_synchronisation(monkeypatch):
    synchronised = []
    monkeypatch.setattr(clock_module.torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(clock_module.torch.cuda, "synchronize", lambda *a, **k: synchronised.append(1))
    policy = FixedDraftLength(length=4)
    updates = []
    monkeypatch.setattr(policy, "update", lambda *args: updates.append(args))
    clock = RoundClock(policy, torch.device("cuda"))
    for round_ in range(3):
        FakeEvent.clock[0] = 10.0 * round_
        clock.start()
        FakeEvent.clock[0] += 0.25  # the draft's device time
        clock.drafted(4)
        clock.finish(2)  # after the acceptance, which read the accepted count
    assert synchronised == []
    assert [u[:2] for u in updates] == [(4, 2)] * 3
    assert all(u[2] == pytest.approx(0.25) and u[3] >= 0.0 for u in updates)


@pytest.mark.parametrize(
    "cache_config",
    [{}, {"lean_step": False}, {"static": False}, {"draft_length": 3, "lean_step": False}],
    ids=["lean", "static", "dynamic", "fixed"],
)
@pytest.mark.parametrize("cache", ["budgeted", "sink_window"])
def test_the_draft_cache_length_is_kept_on_the_host(monkeypatch, cache, cache_config):
    """The generator never reads a static cache's device-side length in a round; its host count must be exact."""
    from hf_budgetdraft import record_speculation
    from hf_budgetdraft.generation.candidate_generator import SparseDraftCandidateGenerator

    target, drafter = model_pair("llama", "sdpa", num_assistant_tokens=None)
    checked = []
    rollback = SparseDraftCandidateGenerator._update_past_and_masks

    def checking(self, input_ids, *args, **kwargs):
        result = rollback(self, input_ids, *args, **kwargs)
        assert self.seen_tokens == _device_length(self.draft_cache) <= input_ids.shape[-1] - 1
        checked.append(self.seen_tokens)
        return result

    monkeypatch.setattr(SparseDraftCandidateGenerator, "_update_past_and_masks", checking)
    ids = random_prompt(150)
    expected = target.generate(ids, do_sample=False, max_new_tokens=30)
    with record_speculation():
        out = target.generate(
            ids,
            assistant_model=drafter,
            do_sample=False,
            max_new_tokens=30,
            cache_implementation=cache,
            cache_config={"compile": False, **cache_config},
        )
    assert torch.equal(out, expected) and len(checked) > 3 and max(checked) > 150


def test_each_reason_names_what_decided_the_choice():
    from transformers import GenerationConfig

    from hf_budgetdraft.generation.plan import resolve_plan
    from hf_budgetdraft.generation.spec import DraftSpec

    target, drafter = model_pair("llama", "sdpa", num_assistant_tokens=None)
    asked = plan_for(target, drafter, cache_config={"lean_step": False, "prefill_window": None})
    assert asked.spec.lean_step is False and asked.reasons["lean_step"] == "cache_config"
    assert asked.spec.prefill_window is None and asked.reasons["prefill_window"] == "cache_config"
    call = GenerationConfig()
    call.update(**call._get_default_generation_params(), defaults_only=True)
    batch = resolve_plan(DraftSpec(), None, target, drafter, call, batched=True)
    assert (
        batch.spec.lean_step is False
        and batch.reasons["lean_step"] == "a batch drafts on ragged per-row caches"
    )
    # each row's prompt is prefilled on its own: the device rule decides the window, as for one sequence
    assert batch.spec.prefill_window == 1024 and "measured on CPU" in batch.reasons["prefill_window"]


def _device_length(cache) -> int:
    """The draft cache's length as its layers hold it: a static layer's device tensor (checked against its host
    count), else the cache's own count."""
    static = [layer for layer in cache.layers if torch.is_tensor(getattr(layer, "length", None))]
    for layer in static:
        assert layer.known_length in (None, int(layer.length))
    return int(static[0].length) if static else int(cache.get_seq_length())


class HostReads(TorchFunctionMode):
    """Counts the tensor values read on the host by the package's own code (`package_only=False`: by any code but
    torch's, transformers' included) — each one a device synchronisation on CUDA (`int()`, `bool()`, `.item()`,
    `.tolist()`, `.nonzero()`, ...) — by the file and function that read it."""

    READS = {
        torch.Tensor.__bool__,
        torch.Tensor.__int__,
        torch.Tensor.__float__,
        torch.Tensor.__index__,
        torch.Tensor.item,
        torch.Tensor.tolist,
        torch.Tensor.nonzero,
        torch.nonzero,
        torch.Tensor.cpu,
        torch.equal,
    }

    def __init__(self, package_only: bool = True):
        super().__init__()
        self.sites = collections.Counter()
        self.package_only = package_only

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            caller = [
                f for f in traceback.extract_stack()[:-1] if f"{os.sep}torch{os.sep}" not in f.filename
            ][-1]
            if not self.package_only or f"{os.sep}hf_budgetdraft{os.sep}" in caller.filename:
                self.sites[f"{os.path.basename(caller.filename)}:{caller.name}"] += 1
        return func(*args, **(kwargs or {}))


CUDA_LIKE = {"static": True, "lean_step": False, "prefill_window": None}  # what a CUDA plan runs, on this CPU


@pytest.mark.parametrize("draft_length", [3, None], ids=["fixed", "adaptive"])
@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampling"])
@pytest.mark.parametrize(
    "cache,sizes",
    [
        ("sink_window", {"num_sink_tokens": 4, "window_length": 48}),
        ("budgeted", {"budget": 48, "window_length": 32}),
    ],
    ids=["sink_window", "budgeted"],
)
def test_a_round_reads_nothing_from_the_device(cache, sizes, do_sample, draft_length):
    """On a static draft cache the package's code reads no tensor value on the host in a whole call — crops, blocks,
    mask sizes, EOS and padding checks included (the prompt outgrows the window, drafts are rejected, EOS is set):
    on CUDA the only synchronisations left are transformers' own loop's (its acceptance and stopping check)."""
    target, drafter = model_pair("llama", "sdpa", num_assistant_tokens=None, draft_layers=1)
    ids = random_prompt(200)
    cache_config = {**CUDA_LIKE, "compile": False, **sizes}
    if draft_length is not None:
        cache_config["draft_length"] = draft_length
    kwargs = dict(max_new_tokens=40, eos_token_id=5, attention_mask=torch.ones_like(ids), do_sample=do_sample)
    torch.manual_seed(0)
    with record_speculation() as stats, HostReads() as reads:
        out = target.generate(
            ids, assistant_model=drafter, cache_implementation=cache, cache_config=cache_config, **kwargs
        )
    assert stats.rounds > 10 and sum(stats.proposed_per_round) > sum(stats.accepted_per_round)
    assert not reads.sites, f"host reads of device tensors: {dict(reads.sites)}"
    if not do_sample:
        assert torch.equal(out, target.generate(ids, **kwargs))


@needs_traceable_transformers
def test_a_compiled_round_reads_nothing_from_the_device(fresh_dynamo):
    """The compiled step cannot count on the host; the draft loop hands the count back before each rollback, so
    rounds still read nothing (but the first compiled call's one check of whether a failed compilation wrote to the
    cache)."""

    target, drafter = model_pair("llama", "budgetdraft_varlen", num_assistant_tokens=None, draft_layers=1)
    backend, graphs = graph_counter()
    drafter.generation_config.compile_config = CompileConfig(fullgraph=True, backend=backend, mode=None)
    ids = random_prompt(200)
    cache_config = {
        **CUDA_LIKE,
        "compile": True,
        "draft_length": 3,
        "num_sink_tokens": 4,
        "window_length": 48,
    }
    with record_speculation() as stats, HostReads() as reads:
        out = target.generate(
            ids,
            assistant_model=drafter,
            cache_implementation="sink_window",
            cache_config=cache_config,
            do_sample=False,
            max_new_tokens=40,
        )
    assert torch.equal(out, target.generate(ids, do_sample=False, max_new_tokens=40))
    assert len(graphs) == 1 and stats.rounds > 10
    first_call_check = {
        "draft_steps.py:_static_lengths",
        "draft_steps.py:<listcomp>",
    }  # (3.12 inlines the latter)
    assert set(reads.sites) <= first_call_check and sum(reads.sites.values()) == 1, dict(reads.sites)
