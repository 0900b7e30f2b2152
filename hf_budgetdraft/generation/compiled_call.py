"""A model's compiled forward whose module guards are checked once per call, not before every step.

Before every call of a compiled frame dynamo checks its guards: for a transformers model, besides the inputs, one
for each module attribute the trace read (its flags, hooks, constants), about two hundred a decoder layer. On a
GPU, where the step itself is a CUDA-graph replay, that check is host time paid every draft step and every
verification. Within one `generate()` call the models do not change, so when a forward compiles as one whole graph
(`fullgraph=True`) the module guards are dropped (`torch.compiler.skip_guard_on_all_nn_modules_unsafe`) and their
job is done once per call instead: each compiled function belongs to one model in one state (`module_fingerprint`),
as a code object of its own, so dynamo never matches its graphs against another model, or against the same model
after a change. Guards on the inputs (tensors, the cache) and on global state stay.
"""

from __future__ import annotations

import types

import torch
from transformers import CompileConfig

from .model_state import model_state

# compiled functions kept per model and compile config (one per state the model was called in)
STATES_KEPT = 4
_PLAIN = frozenset((bool, int, float, str, bytes, type(None), torch.dtype, torch.device))
# module attributes a forward under no_grad never reads (the submodules are walked on their own)
_UNREAD = frozenset(
    (
        "_modules",
        "_backward_hooks",
        "_backward_pre_hooks",
        "_state_dict_hooks",
        "_state_dict_pre_hooks",
        "_load_state_dict_pre_hooks",
        "_load_state_dict_post_hooks",
        "_non_persistent_buffers_set",
        "_is_hf_initialized",
    )
)


def call_model(model, **kwargs):
    """`model(**kwargs)`: the function every compiled forward is a copy of (the model an argument, so the compiled
    function, kept in the model's weakly keyed state, holds no reference to it)."""
    return model(**kwargs)


def _summary(value):
    """What a trace reads from an attribute value that no tensor guard sees: plain values (and containers of them)
    as they are, tensors by their metadata, anything else by type and identity (a hook replaced is a new object)."""
    kind = type(value)
    if kind in _PLAIN:
        return value
    if isinstance(value, torch.Tensor):
        return (kind, value.dtype, value.device, value.shape)
    if isinstance(value, dict):  # a module's parameters, buffers, hooks (mostly empty)
        return (kind, tuple((key, _summary(item)) for key, item in value.items())) if value else kind
    if kind in (tuple, list) and all(type(item) in _PLAIN for item in value):
        return (kind, tuple(value))
    return (kind, id(value))


def module_fingerprint(model) -> int:
    """A hash of what a traced forward of `model` reads besides its inputs: every module's class (and its
    `forward`), training flag, attributes, hooks, parameters' and buffers' dtype, device and shape; the config,
    and the attention implementation in effect where this is called (a per-call scope may set it)."""
    parts = [model.config.to_json_string(use_diff=False)]
    for name, module in model.named_modules():
        config = module.__dict__.get("config")
        attention = getattr(config, "_attn_implementation", None)
        parts.append((name, type(module), type(module).forward, attention))
        parts.extend((key, _summary(value)) for key, value in module.__dict__.items() if key not in _UNREAD)
        parts.append(tuple(module._modules))
    return hash(tuple(parts))


def _config_key(config: CompileConfig) -> str:
    return repr(sorted(config.to_dict().items(), key=lambda item: item[0]))


def _own_call():
    """A copy of `call_model` with a code object of its own: dynamo keeps compiled graphs per code object."""
    return types.FunctionType(call_model.__code__.replace(), call_model.__globals__, "call_model")


def _compile_options(config: CompileConfig) -> dict:
    """`torch.compile` arguments for `config`: its own, plus the module-guard filter where the forward is one graph
    (a graph break would leave entries in code objects other models share) and torch has the filter. The filter
    travels in `options`, which torch takes only without a `mode`: an inductor mode becomes its options."""
    options = config.to_dict()
    drop = getattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe", None)
    if not options.get("fullgraph") or drop is None:
        return options
    mode = options.pop("mode", None)
    if mode is not None:
        if options.get("backend") != "inductor":
            return {**options, "mode": mode}
        options["options"] = {**torch._inductor.list_mode_options(mode), **(options.get("options") or {})}
    options["options"] = {**(options.get("options") or {}), "guard_filter_fn": drop}
    return options


def module_guards_dropped(config: CompileConfig) -> bool:
    """Whether forwards compiled with `config` check their module guards once per call instead of every step."""
    return "guard_filter_fn" in (_compile_options(config).get("options") or {})


def compiled_call(model, config: CompileConfig) -> tuple:
    """`(fn, shapes)`: `call_model` compiled with `config` for `model` in its present state (call it as
    `fn(model, **kwargs)`), and the set of shapes it has compiled (the caller's to fill). Built once per model,
    config and state; the least recently built beyond `STATES_KEPT` per config is dropped with its graphs."""
    state, key, fingerprint = model_state(model), _config_key(config), module_fingerprint(model)
    with state.lock:
        functions = state.compiled.setdefault(key, {})  # fingerprint -> (fn, shapes), oldest first
        if fingerprint not in functions:
            functions[fingerprint] = (torch.compile(_own_call(), **_compile_options(config)), set())
            while len(functions) > STATES_KEPT:
                del functions[next(iter(functions))]
        return functions[fingerprint]


def has_compiled_call(model, config: CompileConfig) -> bool:
    """Whether this process compiled a forward of `model` with `config` (for any state of the model)."""
    state = model_state(model)
    with state.lock:
        return bool(state.compiled.get(_config_key(config)))
