"""Attention implementations chosen per call: `using_attention(model, name)` is seen only by the code inside it.

transformers picks a layer's attention function and its mask function from `config._attn_implementation`, and
`model.set_attn_implementation()` writes that on the config every thread shares: a call that switched it for its
own length would switch it for every other call on the same model, and two overlapping calls would restore each
other's state. Instead, `install()` wraps the `PreTrainedConfig._attn_implementation` property once so that it first
reads an override from a `ContextVar`; `using_attention` sets that variable for the block. Other threads and asyncio
tasks never see it, the config is never written, and a model that drafts for itself can verify on one implementation
and draft on another in the same call.

Under `torch.compile` the override is read once while tracing and kept in the graph (no guard): a compiled step
traced inside a scope is meant for that scope's role only (the draft step's compiled call is owned by the draft side).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar

import torch
from transformers import PreTrainedConfig

# id(config) -> the attention implementation that config runs in this context (a new dict per scope, never mutated)
_OVERRIDES: ContextVar[dict[int, str] | None] = ContextVar("budgetdraft_attention", default=None)
_install_lock = threading.Lock()
_wrapped: set[type] = set()  # config classes besides PreTrainedConfig whose own property install() wrapped


@torch._dynamo.assume_constant_result
def _traced_override(config_id: int) -> str | None:
    overrides = _OVERRIDES.get()
    return None if overrides is None else overrides.get(config_id)


class ScopedAttnImplementation(property):
    """`PreTrainedConfig._attn_implementation` while installed: the current scope's override first, else what the
    property it replaced (`replaced`, put back by `uninstall`) says. Its getter is a plain function, which
    `torch.compile` inlines."""

    def __init__(self, replaced: property):
        def scoped_attn_implementation(config: PreTrainedConfig):
            if torch.compiler.is_compiling():
                name = _traced_override(id(config))
            else:
                overrides = _OVERRIDES.get()
                name = None if overrides is None else overrides.get(id(config))
            return replaced.fget(config) if name is None else name

        super().__init__(scoped_attn_implementation, replaced.fset, replaced.fdel, replaced.__doc__)
        self.replaced = replaced


def install(configs: Iterable[PreTrainedConfig] = ()) -> None:
    """Wrap `PreTrainedConfig._attn_implementation`, and the property of any class of `configs` that defines its own
    (hiding the wrapped one), so that it reads the current scope first (idempotent)."""
    owners = [PreTrainedConfig] + [
        cls for config in configs for cls in type(config).__mro__ if "_attn_implementation" in cls.__dict__
    ]
    with _install_lock:
        for cls in owners:
            current = cls.__dict__["_attn_implementation"]
            if isinstance(current, property) and not isinstance(current, ScopedAttnImplementation):
                cls._attn_implementation = ScopedAttnImplementation(current)
                _wrapped.add(cls)


def uninstall() -> None:
    """Put transformers' own `_attn_implementation` properties back (the next scope wraps them again)."""
    with _install_lock:
        for cls in (PreTrainedConfig, *_wrapped):
            current = cls.__dict__.get("_attn_implementation")
            if isinstance(current, ScopedAttnImplementation):
                cls._attn_implementation = current.replaced
        _wrapped.clear()


def model_configs(model: torch.nn.Module) -> list[PreTrainedConfig]:
    """`model`'s config, its sub-configs at any depth and its sub-modules' configs: what `set_attn_implementation`
    would change."""
    found: dict[int, PreTrainedConfig] = {}
    pending = [m.config for m in model.modules() if isinstance(getattr(m, "config", None), PreTrainedConfig)]
    while pending:
        config = pending.pop()
        if id(config) in found:
            continue
        found[id(config)] = config
        pending += [
            c for key in config.sub_configs if isinstance(c := getattr(config, key, None), PreTrainedConfig)
        ]
    return list(found.values())


def attention_scope(model, implementation: str | None) -> Callable[[], contextlib.AbstractContextManager]:
    """A reusable `using_attention(model, implementation)`: the model's configs are looked up once, so a call can
    enter the scope every round for nothing."""
    # attention outside `AttentionInterface` (`_can_set_attn_implementation()` False) is kept, as transformers does
    if (
        implementation in (None, model.config._attn_implementation)
        or not model._can_set_attn_implementation()
    ):
        return contextlib.nullcontext
    configs = model_configs(model)
    install(configs)
    return functools.partial(_scope, tuple(id(c) for c in configs), implementation)


def using_attention(model, implementation: str | None) -> contextlib.AbstractContextManager:
    """Run `model` on attention `implementation` inside the block, in this thread / task only (`None`: as it is).
    A model whose attention does not dispatch through transformers' `AttentionInterface`
    (`_can_set_attn_implementation()` is False) keeps its attention, as `set_attn_implementation` would."""
    return attention_scope(model, implementation)()


@contextlib.contextmanager
def _scope(config_ids: tuple[int, ...], implementation: str) -> Iterator[None]:
    overrides = {**(_OVERRIDES.get() or {}), **dict.fromkeys(config_ids, implementation)}
    token = _OVERRIDES.set(overrides)
    try:
        yield
    finally:
        _OVERRIDES.reset(token)
