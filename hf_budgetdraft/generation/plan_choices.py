"""How `resolve_plan` decides the automatic choices of a `DraftSpec` for one call: the draft length and where it
came from, the lean draft step, the draft prefill window and the compiled one-token step. Each returns the choice
with the reason `DraftPlan.reasons` reports."""

from __future__ import annotations

from transformers import CompileConfig, GenerationConfig
from transformers.cache_utils import get_layer_types_and_kwargs

from ..cache import has_fixed_shape_steps, is_full_attention_only
from ..cpu import lean_step_problem
from .compiled_step import compile_pays, draft_step_compile_config
from .device_rules import DeviceRules
from .spec import AUTO, DraftSpec
from .static_verify import verify_compile_config

_LENGTH_FIELDS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")


def _explicit(config: GenerationConfig, name: str, defaults: dict):
    value = getattr(config, name, None)
    return None if value is None or value == defaults.get(name) else value


def draft_length_choice(
    spec: DraftSpec, explicit_spec: bool, call, drafter
) -> tuple[int | str, str, float, int]:
    """`(draft length, its source, confidence threshold, heuristic start)`; the `plan` module's docstring has the
    precedence (`explicit_spec`: `cache_config` sets `draft_length`)."""
    defaults = GenerationConfig()._get_default_generation_params()
    sources = (
        ("generate()", {n: _explicit(call, n, defaults) for n in _LENGTH_FIELDS}),
        (
            "drafter.generation_config",
            {n: getattr(drafter.generation_config, n, None) for n in _LENGTH_FIELDS},
        ),
    )
    threshold = float(next((t for _, s in sources if (t := s["assistant_confidence_threshold"])), 0.0))
    start = spec.max_draft_length
    if explicit_spec:
        return spec.draft_length, "cache_config", threshold, start
    for source, values in sources:
        tokens, schedule = values["num_assistant_tokens"], values["num_assistant_tokens_schedule"]
        if schedule in ("heuristic", "heuristic_transient"):
            start = min(int(tokens or defaults["num_assistant_tokens"]), spec.max_draft_length)
            return "heuristic", source, threshold, start
        if tokens is not None:
            if tokens > spec.slack:
                raise ValueError(
                    f"num_assistant_tokens={tokens} exceeds the draft cache's rollback slack ({spec.slack}); pass "
                    f"cache_config={{'slack': {int(tokens)}, ...}} or lower num_assistant_tokens"
                )
            return int(tokens), source, threshold, start
    return spec.draft_length, "default", threshold, start


def lean_step_choice(asked: bool | str, static: bool, drafter, rules: DeviceRules) -> tuple[bool, str | None]:
    """`(lean step on, why not)` for a call: `"auto"` turns it on with a static cache and a drafter it can run, on a
    device whose rules allow it."""
    if asked is False:
        return False, None
    problem = None if static else "the draft cache is not static"
    problem = problem or lean_step_problem(drafter)
    if asked is True and problem is not None:
        raise ValueError(
            f"lean_step=True, but {problem}; drop lean_step (or set it to 'auto') to draft with the drafter's own "
            "forward"
        )
    if asked == AUTO and problem is None and not rules.lean_step:
        problem = f"{rules.device_type}: {rules.reasons['lean_step']}"
    return problem is None, problem


def asked_or(value, batched: bool, rule: str) -> str:
    """The reason of a choice: the caller's setting, a batch's ragged caches, or the device rule."""
    if batched:
        return "a batch drafts on ragged per-row caches"
    return "cache_config" if value != AUTO else rule


def window_choice(spec: DraftSpec, drafter, rules: DeviceRules) -> tuple[int | None, str]:
    """`(prefill window, why)`: `"auto"` windows where the drafter allows it, on a device whose rules allow it (a
    batch's rows too: each row's prompt is prefilled on its own)."""
    window = spec.resolved_prefill_window(drafter.config)
    if spec.prefill_window != AUTO:
        return window, "cache_config"
    if window is None:
        return (
            None,
            "the drafter's layers, its policy's prefill queries or a full draft cache need a full prefill",
        )
    return (window if rules.prefill_window else None), rules.reasons["prefill_window"]


def compile_choice(
    spec: DraftSpec,
    static: bool,
    lean: bool,
    drafter,
    call: GenerationConfig,
    rules: DeviceRules,
    trace_problem: str | None = None,
) -> tuple[bool, CompileConfig, str]:
    """`(compile the one-token draft step, how, why)`; an explicit compile config on the drafter means "compile".
    `trace_problem`: why a traced step of this drafter would not compute its eager step (it then stays eager)."""
    asked = drafter.generation_config.compile_config
    config = asked or draft_step_compile_config(drafter.device)
    compiled = True if spec.compile == AUTO and asked is not None and static else spec.compile
    if compiled is True and not static:
        raise ValueError(
            "compile=True compiles the step of a static draft cache; drop compile or set static=True"
        )
    if call.disable_compile:
        return False, config, "generate(disable_compile=True)"
    if not static:
        return False, config, "the draft cache is not static"
    if trace_problem:
        if spec.compile is True:
            raise ValueError(
                f"compile=True cannot hold: {trace_problem}. Drop compile: the step then runs eagerly"
            )
        return False, config, trace_problem
    if compiled != AUTO:
        return compiled, config, "drafter.generation_config.compile_config" if asked else "cache_config"
    if not has_fixed_shape_steps(drafter.config):
        # convolution / recurrent states kept (with their past, for rollback) in transformers' own layers
        return (
            False,
            config,
            "the drafter has layers besides attention (convolution or recurrent states), whose caches change shape "
            "from step to step: a compiled step would recompile at each",
        )
    if rules.compile_from_first_call:
        return True, config, rules.reasons["compile_from_first_call"]
    if not is_full_attention_only(drafter.config):
        # the saving `compile_pays` expects was measured on full-attention drafters
        return False, config, "a compiled step of a drafter with sliding layers has no measured saving here"
    pays = compile_pays(drafter, config, lean)
    return pays, config, rules.reasons["compile_from_first_call"] + ("" if pays else " (not yet)")


def _device_round_problem(target, batched: bool) -> str | None:
    if batched:
        return "a batch runs the batched loop"
    if target.config.is_encoder_decoder:
        return "the device round verifies decoder-only targets"
    return _target_layers_problem(target)


# attention that builds its masks from the cache's mask sizes, as the device round's rings need
_RING_ATTENTION = ("sdpa", "eager", "budgetdraft_sdpa", "budgetdraft_varlen")


def _target_layers_problem(target) -> str | None:
    """Why the device round's static cache cannot hold `target`'s layers exactly (`None`: it can): full attention,
    sliding windows as rollback rings read through masks, and layers that store nothing."""
    config = target.config.get_text_config(decoder=True)
    layer_types, _ = get_layer_types_and_kwargs(config)
    # ("dummy": a layer that stores nothing, reusing an earlier layer's keys or holding none)
    others = sorted(set(layer_types) - {"full_attention", "sliding_attention", "dummy"})
    if others:
        return f"the target has {others} layers, which the device round's static cache cannot roll back"
    attention = str(config._attn_implementation)
    if "sliding_attention" in layer_types and not attention.endswith(_RING_ATTENTION):
        return (
            f"the target's sliding layers run attn_implementation={attention!r}, which takes a window instead of "
            f"the mask the device round's rings need (one of {list(_RING_ATTENTION)})"
        )
    return None


def device_round_choice(
    spec: DraftSpec, target, batched: bool, rules: DeviceRules, loop_problem: str | None = None
) -> tuple[bool, str]:
    """`(run the device round, why)`: `"auto"` runs it where the device rules do, the target allows it and the
    call asks nothing the loop does not do (`loop_problem`)."""
    problem = _device_round_problem(target, batched) or loop_problem
    if spec.device_round is True and problem is not None:
        raise ValueError(f"device_round=True, but {problem}; drop device_round (or set it to 'auto')")
    if spec.device_round != AUTO:
        return spec.device_round, "cache_config"
    if problem is not None:
        return False, problem
    return rules.device_round, rules.reasons["device_round"]


def verify_compile_choice(
    spec: DraftSpec, device_round: bool, target, call: GenerationConfig, rules: DeviceRules
) -> tuple[CompileConfig | None, str]:
    """`(how the device round's verification compiles (None: eagerly), why)`; `generate(compile_config=...)` says
    how, and means "compile" under `"auto"`."""
    if not device_round:
        if spec.compile_verify is True:
            raise ValueError(
                "compile_verify=True compiles the device round's verification; set device_round=True"
            )
        return None, "transformers' loop verifies"
    if call.disable_compile:
        return None, "generate(disable_compile=True)"
    config = call.compile_config or verify_compile_config(target.device)
    if spec.compile_verify != AUTO:
        return (config if spec.compile_verify else None), "cache_config"
    if call.compile_config is not None:
        return config, "generate(compile_config=...)"
    return (config if rules.device_round else None), rules.reasons["device_round"]
