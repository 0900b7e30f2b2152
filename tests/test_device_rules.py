"""The plan knows its device: the device rules as pure functions, a plan made for a CUDA drafter, and a CUDA round
timed without a synchronisation of its own (CUDA faked on this CPU machine)."""

import pytest
import torch
from test_draft_spec import plan_for
from tiny_models import model_pair, random_prompt

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
    assert set(rules.reasons) == {*CPU_SPEEDUPS, "compile_from_first_call", "round_clock"}


@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_drops_the_cpu_speedups_compiles_at_once_and_times_with_events(device, dtype):
    rules = device_rules(device, dtype)
    assert not any(getattr(rules, name) for name in CPU_SPEEDUPS)
    assert rules.compile_from_first_call and rules.round_clock == "events"
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
    assert cpu.spec.compile is False and "not yet" in cpu.reasons["compile"]
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
    }
    assert plan_for(target, drafter, disable_compile=True).spec.compile is False
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
        assert self.seen_tokens == int(self.draft_cache.get_seq_length()) <= input_ids.shape[-1] - 1
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

    from hf_budgetdraft.generation.plan import DraftSpec, resolve_plan

    target, drafter = model_pair("llama", "sdpa", num_assistant_tokens=None)
    asked = plan_for(target, drafter, cache_config={"lean_step": False, "prefill_window": None})
    assert asked.spec.lean_step is False and asked.reasons["lean_step"] == "cache_config"
    assert asked.spec.prefill_window is None and asked.reasons["prefill_window"] == "cache_config"
    call = GenerationConfig()
    call.update(**call._get_default_generation_params(), defaults_only=True)
    batch = resolve_plan(DraftSpec(), None, target, drafter, call, batched=True)
    assert batch.spec.lean_step is False and batch.spec.prefill_window is None
    assert (
        batch.reasons["lean_step"]
        == batch.reasons["prefill_window"]
        == "a batch drafts on ragged per-row caches"
    )
