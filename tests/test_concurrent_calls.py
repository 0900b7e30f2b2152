"""Calls are independent: threads (and asyncio tasks in executors) share one target and one drafter, and each call's
output equals what it returns alone, while the models stay exactly as loaded, as every other thread sees them.

The paused-call tests are deterministic: a stopping criterion holds a call mid-generation while another thread
inspects the models and runs its own calls, so they fail whenever a call switches anything on the shared models."""

from __future__ import annotations

import asyncio
import gc
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from tiny_models import model_pair, random_prompt
from transformers import DynamicCache, StoppingCriteria, StoppingCriteriaList

from hf_budgetdraft.attention.scoped import model_configs
from hf_budgetdraft.compat import cache_kwargs
from hf_budgetdraft.cpu.few_row_linear import runs_few_row

NEW = 12
TIMEOUT = 120  # seconds a paused call waits before failing the test instead of hanging it


@pytest.fixture(scope="module")
def pair():
    target, drafter = model_pair("llama", "sdpa", num_assistant_tokens=None)
    return target, drafter


def _state(model) -> tuple:
    """What a call could switch on a model: every config's attention, layers' own forwards, what runs few-row."""
    return (
        tuple(c._attn_implementation for c in model_configs(model)),
        tuple(sorted(n for n, m in model.named_modules() if "forward" in m.__dict__)),
        any(runs_few_row(m) for m in model.modules()),
    )


class _Pause(StoppingCriteria):
    """Holds its call at its `at`-th check (after the prefill and a round or more) until `resume` is set."""

    def __init__(self, at: int = 2):
        self.at, self.checks = at, 0
        self.paused, self.resume = threading.Event(), threading.Event()

    def __call__(self, input_ids, scores, **kwargs):
        self.checks += 1
        if self.checks == self.at:
            self.paused.set()
            if not self.resume.wait(TIMEOUT):
                raise TimeoutError("the test never resumed this call")
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _speculative(drafter, cache: str = "budgeted", **cache_config) -> dict:
    return {
        "assistant_model": drafter,
        "cache_implementation": cache,
        "cache_config": cache_config or {"budget": 64},
    }


def _continued(target, drafter) -> dict:
    """The one-liner continuing a cache its caller prefilled with the prompt's first 200 tokens, the drafter's
    windowed prefill continuing the prompt it read in the last such call (shared by every thread)."""
    cache = DynamicCache(config=target.config)
    with torch.no_grad():
        target(random_prompt(300)[:, :200], **cache_kwargs(cache))
    return {**_speculative(drafter, budget=64, prefill_window=64), **cache_kwargs(cache)}


CALLS = {
    "plain": lambda t, d: {},
    "budgeted": lambda t, d: _speculative(d),
    "continued": _continued,
    "sink_window": lambda t, d: _speculative(d, "sink_window", num_sink_tokens=8, window_length=64),
    "self_draft": lambda t, d: _speculative(t),
    "batched": lambda t, d: _speculative(d),
}


def _prompt(name: str) -> torch.LongTensor:
    if name == "batched":
        return torch.cat([random_prompt(300, seed=3), random_prompt(300, seed=4)])
    return random_prompt(300)


def _run(pair, name: str, pause: _Pause | None = None) -> torch.Tensor:
    target, drafter = pair
    criteria = StoppingCriteriaList([pause] if pause else [])
    return target.generate(
        _prompt(name),
        do_sample=False,
        max_new_tokens=NEW,
        stopping_criteria=criteria,
        **CALLS[name](target, drafter),
    )


@pytest.fixture(scope="module")
def alone(pair):
    """Each call's output run alone, one after another in this thread."""
    loaded = [_state(m) for m in pair]
    outputs = {name: _run(pair, name) for name in CALLS}
    assert [_state(m) for m in pair] == loaded
    same = ("budgeted", "continued", "sink_window", "self_draft")
    assert all(torch.equal(outputs[n], outputs["plain"]) for n in same)
    return outputs


def _start(pair, name: str, pause: _Pause, results: dict) -> threading.Thread:
    thread = threading.Thread(target=lambda: results.__setitem__(name, _run(pair, name, pause)), daemon=True)
    thread.start()
    assert pause.paused.wait(TIMEOUT), f"{name} never reached its pause"
    return thread


@pytest.mark.parametrize("held", ["budgeted", "continued", "self_draft", "batched"])
def test_a_call_in_flight_changes_nothing_another_thread_sees(pair, alone, held):
    loaded = [_state(m) for m in pair]
    pause, results = _Pause(), {}
    thread = _start(pair, held, pause, results)
    try:
        assert [_state(m) for m in pair] == loaded  # seen from this thread while the call is held
        for name in ("plain", "sink_window", "budgeted", "continued"):
            assert torch.equal(_run(pair, name), alone[name]), name
    finally:
        pause.resume.set()
        thread.join(TIMEOUT)
    assert torch.equal(results[held], alone[held])
    assert [_state(m) for m in pair] == loaded


def test_overlapping_calls_that_end_out_of_order_leave_the_models_as_loaded(pair, alone):
    loaded = [_state(m) for m in pair]
    first, second, results = _Pause(), _Pause(), {}
    threads = [_start(pair, "budgeted", first, results), _start(pair, "self_draft", second, results)]
    first.resume.set()  # the call that started first ends first
    threads[0].join(TIMEOUT)
    assert [_state(m) for m in pair] == loaded
    second.resume.set()
    threads[1].join(TIMEOUT)
    assert torch.equal(results["budgeted"], alone["budgeted"])
    assert torch.equal(results["self_draft"], alone["self_draft"])
    assert [_state(m) for m in pair] == loaded


def test_many_threads_at_once_match_their_calls_alone(pair, alone):
    names = list(CALLS) * 2
    with ThreadPoolExecutor(max_workers=4) as pool:
        outputs = list(pool.map(lambda name: _run(pair, name), names))
    for name, output in zip(names, outputs, strict=True):
        assert torch.equal(output, alone[name]), name


def test_asyncio_tasks_in_executors_match_their_calls_alone(pair, alone):
    async def main():
        loop = asyncio.get_running_loop()
        return await asyncio.gather(*(loop.run_in_executor(None, _run, pair, name) for name in CALLS))

    for name, output in zip(CALLS, asyncio.run(main()), strict=True):
        assert torch.equal(output, alone[name]), name


class _Interrupt(StoppingCriteria):
    def __init__(self, error: BaseException, at: int = 2):
        self.error, self.at, self.checks = error, at, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.checks += 1
        if self.checks == self.at:
            raise self.error
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@pytest.mark.parametrize("name", ["budgeted", "sink_window", "self_draft", "batched"])
@pytest.mark.parametrize("error", [RuntimeError("stop here"), KeyboardInterrupt()])
def test_an_exception_mid_call_leaves_the_models_usable(pair, alone, name, error):
    target, drafter = pair
    loaded = [_state(m) for m in pair]
    criteria = StoppingCriteriaList([_Interrupt(error)])
    with pytest.raises(type(error)):
        target.generate(
            _prompt(name),
            do_sample=False,
            max_new_tokens=NEW,
            stopping_criteria=criteria,
            **CALLS[name](*pair),
        )
    assert [_state(m) for m in pair] == loaded
    assert torch.equal(_run(pair, name), alone[name])


def _live_tensors() -> int:
    return sum(1 for o in gc.get_objects() if torch.is_tensor(o))


def test_consecutive_calls_keep_live_tensors_flat(pair, alone):
    """A short soak (`benchmarks/soak.py` runs 1,000 calls and measures RSS too): after a warm-up round, the
    number of live tensors is the same after every round of calls on every path, greedy and sampling."""
    target, _ = pair

    def round_of_calls():
        for name in CALLS:
            _run(pair, name)
        torch.manual_seed(0)
        target.generate(_prompt("budgeted"), do_sample=True, max_new_tokens=NEW, **CALLS["budgeted"](*pair))
        gc.collect()
        return _live_tensors()

    round_of_calls()
    counts = [round_of_calls() for _ in range(3)]
    assert counts == [counts[0]] * 3, counts
