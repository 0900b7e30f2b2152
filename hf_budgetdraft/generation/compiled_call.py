"""A model's compiled forward whose module guards are checked once per call, not before every step.

Before every call of a compiled frame dynamo checks its guards: for a transformers model, besides the inputs, one
for each module attribute the trace read (its flags, hooks, constants), about two hundred a decoder layer. On a
GPU, where the step itself is a CUDA-graph replay, that check is host time paid every draft step and every
verification. Within one `generate()` call the models do not change, so when a forward compiles as one whole graph
(`fullgraph=True`) the module guards are dropped (`torch.compiler.skip_guard_on_all_nn_modules_unsafe`) and their
job is done once per call instead: each compiled function belongs to one model state (`module_fingerprint`), as a
code object of its own, so dynamo never matches its graphs against a model in another state (another model, or the
same model after a change). Guards on the inputs (tensors, the cache) and on global state stay.
"""

from __future__ import annotations

import threading
import types
from collections import OrderedDict

import torch
from transformers import CompileConfig

from .model_state import model_state

# compiled functions kept in the process, one per compile config, model state and variant (models in the same state,
# such as copies of one model, share one: its graphs read the weights and caches they are given)
FUNCTIONS_KEPT = 16
# (compile config key, fingerprint, variant) -> (fn, shapes), least recently used first
_functions: OrderedDict = OrderedDict()
_functions_lock = threading.Lock()
_PLAIN = frozenset((bool, int, float, str, bytes, type(None), torch.dtype, torch.device))
# module attributes a forward under no_grad never reads (the submodules are walked on their own; a module's
# config is read through the model's, whole, and the attention implementation noted for each module)
_UNREAD = frozenset(
    (
        "_modules",
        "config",
        "generation_config",
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
    function, kept for later calls, holds no reference to it)."""
    return model(**kwargs)


def _summary(value):
    """What a trace reads from an attribute value that no tensor guard sees: plain values and containers by content,
    tensors by their metadata, a module held outside the module tree by its class (transformers' kernel wrappers),
    anything else by type and identity (a hook replaced is a new object)."""
    kind = type(value)
    if kind in _PLAIN:
        return value
    if isinstance(value, torch.Tensor):
        return (kind, value.dtype, value.device, value.shape)
    if isinstance(value, dict):  # a module's parameters, buffers, hooks (mostly empty)
        return (kind, tuple((key, _summary(item)) for key, item in value.items())) if value else kind
    if kind in (tuple, list):
        return (kind, tuple(_summary(item) for item in value))
    if kind in (set, frozenset) and all(type(item) in _PLAIN for item in value):
        return (kind, frozenset(value))
    if isinstance(value, torch.nn.Module):
        return kind
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


def compiled_call(model, config: CompileConfig, variant: tuple = ()) -> tuple:
    """`(fn, shapes)`: `call_model` compiled with `config` for models in `model`'s present state (call it as
    `fn(model, **kwargs)`), and the set of shapes it has compiled (the caller's to fill). Built once per config,
    model state and `variant`: a function of its own, so its graphs count against dynamo's recompile limit (per
    code object) apart from those of other variants (a verification's cache size). The least recently used beyond
    `FUNCTIONS_KEPT` is dropped with its graphs."""
    key = (_config_key(config), module_fingerprint(model), variant)
    with _functions_lock:
        if key in _functions:
            _functions.move_to_end(key)
        else:
            _functions[key] = (torch.compile(_own_call(), **_compile_options(config)), set())
            while len(_functions) > FUNCTIONS_KEPT:
                _functions.popitem(last=False)
        entry = _functions[key]
    state = model_state(model)
    with state.lock:
        state.compiled.add(key[0])
    return entry


def has_compiled_call(model, config: CompileConfig) -> bool:
    """Whether this process compiled a forward of `model` with `config` (in any state of the model)."""
    state = model_state(model)
    with state.lock:
        return _config_key(config) in state.compiled
