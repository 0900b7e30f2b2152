"""`few_row_linear`: `F.linear`'s result (to float rounding) for a decode step's few rows, `F.linear` itself beyond
`MAX_ROWS` and under autograd, and run only inside the block it is asked for, by the thread that entered it."""

import threading

import pytest
import torch
import torch.nn.functional as F
from tiny_models import model_pair, random_prompt
from torch import nn

from hf_budgetdraft import record_speculation
from hf_budgetdraft.cpu.few_row_linear import (
    MAX_ROWS,
    few_row_linear,
    few_row_linear_applies,
    few_row_linears,
    runs_few_row,
)
from hf_budgetdraft.runs.timed_call import ar_setup


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 1), (1, 2), (1, 7), (3, 5), (1, MAX_ROWS), (MAX_ROWS,)])
def test_matches_f_linear_for_few_rows(bias, shape):
    torch.manual_seed(0)
    layer = nn.Linear(96, 160, bias=bias)
    x = torch.randn(*shape, 96)
    with torch.no_grad():
        out = few_row_linear(layer, x)
        expected = F.linear(x, layer.weight, layer.bias)
    assert out.shape == expected.shape and out.is_contiguous()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_more_rows_and_autograd_run_f_linear_itself():
    torch.manual_seed(0)
    layer = nn.Linear(32, 48)
    many = torch.randn(1, MAX_ROWS + 1, 32)
    with torch.no_grad():
        assert torch.equal(few_row_linear(layer, many), F.linear(many, layer.weight, layer.bias))
    few = torch.randn(1, 3, 32)
    out = few_row_linear(layer, few)  # the weight requires grad: training keeps its own path
    assert torch.equal(out, F.linear(few, layer.weight, layer.bias))
    out.sum().backward()
    assert layer.weight.grad is not None


def _swapped(model) -> bool:
    return any(runs_few_row(m) for m in model.modules())


class _OwnLinear(nn.Linear):
    pass


def test_runs_plain_float32_cpu_linears_for_the_block_only():
    custom = nn.Linear(8, 8)
    custom.forward = lambda x: x  # an instance forward set by someone else is left alone
    model = nn.Sequential(nn.Linear(8, 8), _OwnLinear(8, 8), nn.Linear(8, 8).to(torch.bfloat16), custom)
    with few_row_linears(model):
        patched = [runs_few_row(m) for m in model]
        assert torch.equal(model[0](torch.ones(1, 8)), few_row_linear(model[0], torch.ones(1, 8)))
    assert patched == [True, False, False, False]
    assert [("forward" in m.__dict__) for m in model] == [False, False, False, True]  # no layer is written to
    with pytest.raises(RuntimeError, match="boom"), few_row_linears(model):
        raise RuntimeError("boom")
    assert not runs_few_row(model[0])
    with few_row_linears(model, enabled=False):
        assert not runs_few_row(model[0])
    assert few_row_linear_applies(model) and not few_row_linear_applies(nn.Sequential(_OwnLinear(8, 8)))


def test_another_thread_keeps_f_linear_while_a_block_is_open():
    model = nn.Sequential(nn.Linear(8, 8))
    seen = []
    with few_row_linears(model):
        thread = threading.Thread(target=lambda: seen.append(runs_few_row(model[0])))
        thread.start()
        thread.join()
        seen.append(runs_few_row(model[0]))
    assert seen == [False, True]


def test_the_fast_ar_setup_and_the_one_liner_use_it_and_restore_it():
    target, drafter = model_pair("llama", "sdpa", num_assistant_tokens=None)
    seen = []
    hook = target.model.layers[0].mlp.register_forward_hook(lambda *_: seen.append(_swapped(target)))
    ids = random_prompt(300)
    with ar_setup(target, "fast", 400) as kwargs:
        fast = target.generate(ids, do_sample=False, max_new_tokens=8, **kwargs)
    assert seen and all(seen) and not _swapped(target)
    seen.clear()
    with ar_setup(target, "stock", 400) as kwargs:
        stock = target.generate(ids, do_sample=False, max_new_tokens=8, **kwargs)
    assert seen and not any(seen) and torch.equal(fast, stock)
    seen.clear()
    for fast_verify in (True, False):
        with record_speculation() as stats:
            target.generate(
                ids, assistant_model=drafter, max_new_tokens=8, cache_implementation="budgeted",
                cache_config={"budget": 64, "fast_verify": fast_verify},
            )  # fmt: skip
        assert stats.plan.target_linear is fast_verify and all(s is fast_verify for s in seen)
        assert not _swapped(target) and not _swapped(drafter)
        seen.clear()
    hook.remove()


class LinearOnlyWeight(torch.Tensor):
    """A weight that, like a quantised tensor subclass (torchao's int8 weights), computes `F.linear` its own way and
    refuses a plain matmul."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in (torch.mm, torch.addmm, torch.matmul, torch.Tensor.mm, torch.Tensor.t):
            raise NotImplementedError(f"{func.__name__} on a quantised weight")
        if func is torch.Tensor.detach:  # a Parameter of it stays one
            return super().__torch_function__(func, types, args, kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))  # plain tensors out


def test_a_target_with_quantised_weights_keeps_its_own_linear():
    target, drafter = model_pair("llama", "sdpa", num_assistant_tokens=None)
    ids = random_prompt(200)
    expected = target.generate(ids, do_sample=False, max_new_tokens=16)
    for layer in target.modules():
        if type(layer) is nn.Linear:
            layer.weight = nn.Parameter(
                layer.weight.detach().as_subclass(LinearOnlyWeight), requires_grad=False
            )
    assert not few_row_linear_applies(target)
    assert torch.equal(target.generate(ids, do_sample=False, max_new_tokens=16), expected)
    with record_speculation() as stats:
        out = target.generate(
            ids, assistant_model=drafter, do_sample=False, max_new_tokens=16, cache_implementation="budgeted"
        )
    assert torch.equal(out, expected) and stats.plan.target_linear is False
