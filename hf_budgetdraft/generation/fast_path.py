"""Resolve a `DraftSpec` against the models of one call (`DraftPlan`) and apply it for the call only.

What the defaults turn on, and when:

- **static draft cache** where the drafter's attention layers pass their kwargs to `cache.update` (the slot mask
  travels that way); the drafter then runs `budgetdraft_varlen` for the call (only from `sdpa`-family attention);
- **lean draft steps** (`lean_step`) with a static cache, where the drafter has Llama's layout: the steps run straight
  on its weights, without transformers' per-module Python (`lean_step.py`);
- **compiled one-token draft step** (`draft_step_compile_config`, or the drafter's own
  `generation_config.compile_config`, which also means "compile now") once it pays: a compilation costs seconds to
  tens of seconds on CPU, a step saves a fraction of a millisecond, so `"auto"` rents before it buys (ski rental):
  it compiles when this process has spent `COMPILE_SECONDS_ESTIMATE / COMPILED_STEP_SAVING` seconds in eager
  static draft steps of that drafter, and reuses a step compiled earlier in the process at once;
- **cheap verification**: a target loaded with `sdpa` verifies on `budgetdraft_sdpa` (same maths without the GQA
  KV copies), and a float32 target on CPU runs its linear layers as few-row GEMMs on every thread
  (`few_row_linear.py`); logits agree to float rounding;
- **windowed draft prefill** (`prefill_window`, 1024) for a single sequence and a full-attention drafter whose
  policy does not score the prefix with the prefill's queries;
- **draft length**: explicit settings first (`cache_config["draft_length"]`, then `num_assistant_tokens` /
  its schedule / `assistant_confidence_threshold` passed to `generate()` when they differ from transformers'
  defaults, then the drafter's own `generation_config`), else `"adaptive"`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from transformers import CompileConfig, GenerationConfig

from ..attention.fast_sdpa import NAME as FAST_SDPA
from ..attention.scoped import attention_scope, using_attention
from ..attention.varlen import NAME as VARLEN
from ..few_row_linear import few_row_linear_applies, few_row_linears
from .device_rules import DeviceRules, device_rules
from .lean_step import lean_step_problem
from .spec import AUTO, DraftSpec

SDPA_FAMILY = ("sdpa", FAST_SDPA, VARLEN)
COMPILE_SECONDS_ESTIMATE = 45.0  # a cold inductor compilation of a small drafter's step on CPU
# share of a static step a compiled one saves: of the drafter's own eager forward, of a lean step
COMPILED_STEP_SAVING = {"eager": 0.5, "lean": 0.2}
_eager_step_seconds: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def draft_step_compile_config(device: torch.device | str) -> CompileConfig:
    """How to compile a static draft cache's one-token step (set it as `drafter.generation_config.compile_config`).

    One graph of fixed shapes (`dynamic=False`) for the whole generation. CUDA: one whole graph replayed as a CUDA
    graph (`reduce-overhead`'s `triton.cudagraphs`) without inductor's graph partitions, whose generated code
    failed on torch 2.11 for this step while the unpartitioned graph ran (`docs/gpu.md`). Elsewhere: inductor
    with its C++ wrapper, which calls the generated kernels from C++ instead of a Python wrapper; for a small
    drafter the step is mostly that overhead. The C++ wrapper makes the first compilation slower.
    """
    if torch.device(device).type == "cuda":
        return CompileConfig(
            fullgraph=True,
            dynamic=False,
            mode=None,
            options={"triton.cudagraphs": True, "graph_partition": False},
        )
    return CompileConfig(dynamic=False, mode=None, options={"cpp_wrapper": True})


@functools.cache
def _passes_kwargs_to_cache(attention_class: type) -> bool:
    try:
        source = inspect.getsource(attention_class.forward)
    except (OSError, TypeError):
        return False
    return re.search(r"\.update\([^)]*\bkwargs=kwargs", source) is not None


def supports_static_cache(model) -> bool:
    """Whether every attention layer of `model` hands its kwargs to `cache.update` (a static cache needs it)."""
    classes = {
        type(m) for m in model.modules() if hasattr(m, "layer_idx") and "Attention" in type(m).__name__
    }
    return bool(classes) and all(_passes_kwargs_to_cache(c) for c in classes)


def record_eager_steps(drafter, seconds: float) -> None:
    """Add eager static draft-step time spent by `drafter` in this process (the rent of the ski rental)."""
    _eager_step_seconds[drafter] = _eager_step_seconds.get(drafter, 0.0) + seconds


def compile_pays(drafter, compile_config: CompileConfig, lean: bool = False) -> bool:
    """A step compiled earlier in this process is reused; otherwise compile once the uncompiled steps spent so far
    (`lean`: lean steps) would have paid for the compilation."""
    if (
        getattr(drafter, "_compiled_call", None) is not None
        and drafter._last_compile_config == compile_config
    ):
        return True
    saving = COMPILED_STEP_SAVING["lean" if lean else "eager"]
    return _eager_step_seconds.get(drafter, 0.0) * saving >= COMPILE_SECONDS_ESTIMATE


def verify_attention(target, fast_verify: bool) -> str | None:
    """The attention the target verifies on for a call: `budgetdraft_sdpa` when `fast_verify` and the target was
    loaded with `sdpa` (and can switch: Falcon-style attention ignores it), else `None` (as loaded)."""
    fast = (
        fast_verify and target.config._attn_implementation == "sdpa" and target._can_set_attn_implementation()
    )
    return FAST_SDPA if fast else None


@dataclass(frozen=True)
class DraftPlan:
    """A `DraftSpec` resolved for one call: every `"auto"` decided, the draft-length source named.

    Attributes:
        spec (`DraftSpec`): the spec with `static` / `lean_step` / `compile` resolved to bools and `draft_length` to
            the policy that runs (`"adaptive"`, `"heuristic"` or an int).
        draft_length_source (`str`): where the draft length came from.
        lean_step_problem (`str`, *optional*): why `"auto"` left the lean step off for this drafter.
        confidence_threshold (`float`): a round's draft stops at a token the drafter gives less probability (0: off).
        heuristic_start (`int`): the first round's length under the `"heuristic"` schedule.
        draft_attention (`str`, *optional*): attention set on the drafter for the call (`None`: untouched).
        target_attention (`str`, *optional*): attention set on the target for the call (`None`: untouched).
        target_linear (`bool`): the target's linear layers run `few_row_linear` for the call.
        compile_config (`CompileConfig`, *optional*): how the one-token draft step compiles, when it does.
        device_type (`str`): the drafter's device type the choices were made for (`device_rules.py`).
        reasons (`dict[str, str]`): why each automatic choice came out as it did (measured, or an estimate).
    """

    spec: DraftSpec
    draft_length_source: str = "default"
    lean_step_problem: str | None = None
    confidence_threshold: float = 0.0
    heuristic_start: int = 16
    draft_attention: str | None = None
    target_attention: str | None = None
    target_linear: bool = False
    compile_config: CompileConfig | None = None
    device_type: str = "cpu"
    reasons: dict = field(default_factory=dict, compare=False)

    @contextlib.contextmanager
    def applied(self, target) -> Iterator[None]:
        """The target's side of the plan inside the block, for this thread / task only: its verification attention
        and few-row linear layers. The models themselves are never written to."""
        with using_attention(target, self.target_attention), few_row_linears(target, self.target_linear):
            yield

    def drafting(self, drafter) -> Callable[[], contextlib.AbstractContextManager]:
        """The drafter's side: a scope to enter around each draft phase (and the draft cache's construction), which
        runs the drafter on `draft_attention`; a model that drafts for itself verifies outside it."""
        return attention_scope(drafter, self.draft_attention)


_LENGTH_FIELDS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")


def _explicit(config: GenerationConfig, name: str, defaults: dict):
    value = getattr(config, name, None)
    return None if value is None or value == defaults.get(name) else value


def _draft_length(spec: DraftSpec, explicit_spec: bool, call, drafter) -> tuple[int | str, str, float, int]:
    """`(draft length, its source, confidence threshold, heuristic start)`; the module docstring has the
    precedence."""
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


def _lean_step(asked: bool | str, static: bool, drafter, rules: DeviceRules) -> tuple[bool, str | None]:
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


def _static_choice(spec: DraftSpec, drafter) -> tuple[bool, str]:
    can_be_static = supports_static_cache(drafter)
    if spec.static != AUTO:
        if spec.static and not can_be_static:
            raise ValueError(
                f"static=True needs a drafter whose attention passes its kwargs to cache.update; "
                f"{type(drafter).__name__}'s does not. Use cache_config={{'static': False}}"
            )
        return spec.static, "cache_config"
    if not can_be_static:
        return False, f"{type(drafter).__name__}'s attention does not pass its kwargs to cache.update"
    if drafter.config._attn_implementation not in SDPA_FAMILY:
        return (
            False,
            f"the drafter runs {drafter.config._attn_implementation!r}, not an sdpa-family attention",
        )
    return True, "the drafter's layers allow fixed slot buffers read by budgetdraft_varlen"


def _compile_choice(
    spec: DraftSpec, static: bool, lean: bool, drafter, call: GenerationConfig, rules: DeviceRules
) -> tuple[bool, CompileConfig, str]:
    """`(compile the one-token draft step, how, why)`; an explicit compile config on the drafter means "compile"."""
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
    if compiled != AUTO:
        return compiled, config, "drafter.generation_config.compile_config" if asked else "cache_config"
    if rules.compile_from_first_call:
        return True, config, rules.reasons["compile_from_first_call"]
    pays = compile_pays(drafter, config, lean)
    return pays, config, rules.reasons["compile_from_first_call"] + ("" if pays else " (not yet)")


def resolve_plan(
    spec: DraftSpec, cache_config: dict | None, target, drafter, call: GenerationConfig, batched: bool = False
) -> DraftPlan:
    """Decide every `"auto"` of `spec` for this target, drafter and `generate()` config (`batched`: a call of
    several rows, whose draft caches are the ragged ones: never static, lean or compiled), from the rules of the
    drafter's device (`device_rules.py`); `DraftPlan.reasons` says why each choice came out as it did."""
    rules = device_rules(drafter.device, drafter.dtype)
    window = spec.resolved_prefill_window(drafter.config, batched)
    window_reason = "cache_config" if spec.prefill_window != AUTO else rules.reasons["prefill_window"]
    if spec.prefill_window == AUTO and not rules.prefill_window:
        window = None
    spec = spec.replace(prefill_window=window)
    if batched:
        if True in (spec.static, spec.lean_step, spec.compile):
            raise ValueError(
                "static=True / lean_step=True / compile=True are single-sequence fast paths; a batch drafts on ragged "
                "per-row caches. Drop them from cache_config for batched calls"
            )
        spec = spec.replace(static=False, lean_step=False, compile=False)
    static, static_reason = _static_choice(spec, drafter)
    lean, lean_problem = _lean_step(spec.lean_step, static, drafter, rules)
    compiled, compile_config, compile_reason = _compile_choice(spec, static, lean, drafter, call, rules)
    length, source, threshold, start = _draft_length(
        spec, "draft_length" in (cache_config or {}), call, drafter
    )
    target_rules = device_rules(target.device, target.dtype)
    target_linear = spec.fast_verify and target_rules.few_row_linear and few_row_linear_applies(target)
    return DraftPlan(
        spec=spec.replace(static=static, lean_step=lean, compile=compiled, draft_length=length),
        draft_length_source=source,
        lean_step_problem=lean_problem,
        confidence_threshold=threshold,
        heuristic_start=start,
        draft_attention=VARLEN if static else None,
        target_attention=verify_attention(target, spec.fast_verify),
        target_linear=target_linear,
        compile_config=compile_config if compiled else None,
        device_type=rules.device_type,
        reasons={
            "static": static_reason,
            "lean_step": lean_problem
            or ("cache_config" if spec.lean_step is True else rules.reasons["lean_step"]),
            "compile": compile_reason,
            "prefill_window": window_reason,
            "target_linear": target_rules.reasons["few_row_linear"]
            if spec.fast_verify
            else "fast_verify=False",
            "draft_length": source,
            "round_clock": rules.reasons["round_clock"],
        },
    )
