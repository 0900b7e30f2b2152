"""What a speculative `generate()` call runs (`DraftPlan`): its `DraftSpec` (`spec.py`) resolved for one call's models.

`resolve_plan` decides each `"auto"` (each choice in `plan_choices.py`); choices that depend on the device come from
`device_rules.py`, and `DraftPlan.reasons` says why each came out as it did. What the defaults turn on, and when:

- **static draft cache** where the drafter's attention layers pass their kwargs to `cache.update` or hand the keys
  it returns to the attention function as they are (the slot mask travels one way or the other) and add no position
  bias over the keys (Inkling's relative bias: built on contiguous key positions); the drafter then runs
  `budgetdraft_varlen` for the call (only from `sdpa`-family attention);
- **compiled one-token draft step** (`compiled_step.py`, or the drafter's own `generation_config.compile_config`,
  which also means "compile now"): on CUDA from the first call, on CPU once it pays for its compilation; never
  where layers reusing an earlier layer's keys copy them first (transformers 5.22's Gemma 3n / Gemma 4: a traced
  step would lose their slot mask);
- **cheap verification**: a target loaded with `sdpa` verifies on `budgetdraft_sdpa` (same maths without the GQA
  KV copies); logits agree to float rounding;
- **the CPU speed-ups** (`cpu/`), on CPU only: lean draft steps on a Llama-layout drafter's weights, few-row linear
  layers for a float32 target, and a windowed draft prefill (1024-token chunks) for a single sequence and a
  full-attention drafter whose policy does not score the prefix with the prefill's queries;
- **the device round** (`device_loop.py`), on CUDA: the package's own loop, the target on a static cache (sliding
  layers as rollback rings) verifying through a compiled forward (`static_verify.py`), acceptance on the device,
  one host read a round; elsewhere transformers' loop with the target on a `GrowableCache`;
- **draft length**: explicit settings first (`cache_config["draft_length"]`, then `num_assistant_tokens` /
  its schedule / `assistant_confidence_threshold` passed to `generate()` when they differ from transformers'
  defaults, then the drafter's own `generation_config`), else `"adaptive"`.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import re
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from transformers import CompileConfig, GenerationConfig

from ..attention.fast_sdpa import NAME as FAST_SDPA
from ..attention.scoped import attention_scope, using_attention
from ..attention.varlen import NAME as VARLEN
from ..compat import activate_past_recording
from ..cpu import few_row_linear_applies, few_row_linears
from .device_rules import device_rules
from .plan_choices import (
    asked_or,
    compile_choice,
    device_round_choice,
    draft_length_choice,
    lean_step_choice,
    verify_compile_choice,
    window_choice,
)
from .spec import AUTO, DraftSpec

SDPA_FAMILY = ("sdpa", FAST_SDPA, VARLEN)


def _nodes(source: str) -> list[ast.AST]:
    """Every node of a parsed method `source`."""
    return list(ast.walk(ast.parse(textwrap.dedent(source))))


def _attention_calls(nodes: list[ast.AST]) -> list[ast.Call]:
    """The `attention_interface(...)` calls among `nodes`."""
    return [
        n for n in nodes if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "attention_interface"
    ]


def _keys_reach_attention_unchanged(source: str) -> bool:
    """Whether the attention `forward` of `source` hands the keys `cache.update` returns to transformers' attention
    function as they are: one update, one `attention_interface(...)` call taking them as its keys, the name not bound
    again between the two."""
    nodes = _nodes(source)
    calls = _attention_calls(nodes)
    updates = [
        n
        for n in nodes
        if isinstance(n, ast.Assign)
        and isinstance(n.value, ast.Call)
        and getattr(n.value.func, "attr", None) == "update"
        and isinstance(n.targets[0], ast.Tuple)
    ]
    if len(calls) != 1 or len(updates) != 1 or len(calls[0].args) < 3:
        return False
    (call,), (update,) = calls, updates
    key = getattr(update.targets[0].elts[0], "id", None)
    rebound = any(
        isinstance(n, ast.Name) and n.id == key and isinstance(n.ctx, ast.Store)
        for n in nodes
        if update.lineno < getattr(n, "lineno", 0) < call.lineno
    )
    return key is not None and getattr(call.args[2], "id", None) == key and not rebound


def static_source_problem(name: str, source: str) -> str | None:
    """Why an attention layer `name` whose `forward` is `source` cannot read a static draft cache (`None`: it can).
    The step's slot mask reaches the attention function in the kwargs the layer passes to `cache.update`, or else
    with the key buffer the step returns, which must then reach it as it is; and the layer adds no position bias
    built on contiguous key positions (Inkling's: `arange(kv_length) + kv_offset`), which a step's slots are not."""
    passes_kwargs = re.search(r"\.update\([^)]*\bkwargs=kwargs", source) is not None
    if not (passes_kwargs or _keys_reach_attention_unchanged(source)):
        return (
            f"{name} neither passes its kwargs to cache.update nor hands the keys it returns to the attention "
            "function as they are (the slot mask travels one way or the other)"
        )
    if re.search(r"\bposition_bias=", source):
        return f"{name} adds a position bias built on contiguous key positions, which a static cache's slots are not"
    return None


@functools.cache
def _class_problem(attention_class: type, source_problem: Callable[[str, str], str | None]) -> str | None:
    """`source_problem(name, source)` of `attention_class`'s `forward` (once per class and check)."""
    try:
        return source_problem(attention_class.__name__, inspect.getsource(attention_class.forward))
    except (OSError, TypeError, SyntaxError):
        return f"{attention_class.__name__}'s source cannot be read to check how it hands its keys over"


def copied_reused_keys_problem(name: str, source: str) -> str | None:
    """Why a compiled step of a layer `name` that reuses an earlier layer's keys (Gemma 3n / Gemma 4 past their
    KV-sharing point) would lose their slot mask (`None`: it keeps it). Such a layer finds the mask through the key
    buffer it is handed; one whose `forward` (`source`) hands the attention function a `.to(...)` of the keys
    (transformers 5.22) hands it the buffer itself when it runs eagerly, a new tensor without the owner when traced."""
    nodes = _nodes(source)
    keys = {getattr(c.args[2], "id", None) for c in _attention_calls(nodes) if len(c.args) >= 3} - {None}
    copied = any(
        isinstance(n, ast.Assign)
        and any(getattr(t, "id", None) in keys for t in n.targets)
        and isinstance(n.value, ast.Call)
        and getattr(n.value.func, "attr", None) == "to"
        for n in nodes
    )
    if copied:
        return (
            f"{name} hands the attention function a .to(...) copy of the keys it reuses, which a traced step cannot "
            "trace back to their slot mask (it would attend to stale slots)"
        )
    return None


def compiled_step_problem(model) -> str | None:
    """Why a compiled step of `model` on a static draft cache would not compute the eager step (`None`: it would)."""
    classes = {type(m) for m in model.modules() if getattr(m, "is_kv_shared_layer", False) is True}
    return next(
        (problem for c in classes if (problem := _class_problem(c, copied_reused_keys_problem))), None
    )


def static_cache_problem(model) -> str | None:
    """Why `model` cannot draft on a static draft cache (`None`: every attention layer can)."""
    classes = {
        type(m) for m in model.modules() if hasattr(m, "layer_idx") and "Attention" in type(m).__name__
    }
    if not classes:
        return f"{type(model).__name__} has no attention layers with a layer_idx"
    return next((problem for c in classes if (problem := _class_problem(c, static_source_problem))), None)


def supports_static_cache(model) -> bool:
    """Whether every attention layer of `model` can read a static draft cache (`static_cache_problem`)."""
    return static_cache_problem(model) is None


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
        device_round (`bool`): the call runs the device round (`device_loop.py`).
        verify_compile_config (`CompileConfig`, *optional*): how the device round's verification compiles
            (`None`: eagerly).
        coarse_verify_buckets (`bool`): the device round verifies in two length buckets, 1 and its longest round
            (the target's device rules; `static_verify.buckets`).
        compiled_catch_up (`int`): a draft block of up to this many tokens runs through the compiled one-token step,
            a token at a time (0: never; the device rules' choice, applied only where the step compiles).
        device_type (`str`): the drafter's device type the choices were made for (`device_rules.py`).
        batched (`bool`): the call runs the batched loop (`DraftSpec.runs_batched`).
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
    device_round: bool = False
    verify_compile_config: CompileConfig | None = None
    coarse_verify_buckets: bool = False
    compiled_catch_up: int = 0
    device_type: str = "cpu"
    batched: bool = False
    reasons: dict = field(default_factory=dict, compare=False)

    @contextlib.contextmanager
    def applied(self, target) -> Iterator[None]:
        """The target's side of the plan inside the block, for this thread / task only: its verification attention
        and few-row linear layers. The models themselves are never written to."""
        with using_attention(target, self.target_attention), few_row_linears(target, self.target_linear):
            yield

    def draft_cache(self, drafter):
        """The call's draft cache for `drafter`, built inside its drafting scope (a static cache checks the
        attention its drafter runs), its transformers layers (sliding windows, convolution and recurrent states)
        recording their past so that a round's drafts, up to the slack, roll back."""
        with self.drafting(drafter)():
            cache = self.spec.build_cache(drafter.config)
        activate_past_recording(cache, recurrent_states_to_keep=self.spec.slack)
        return cache

    def drafting(self, drafter) -> Callable[[], contextlib.AbstractContextManager]:
        """The drafter's side: a scope to enter around each draft phase (and the draft cache's construction), which
        runs the drafter on `draft_attention`; a model that drafts for itself verifies outside it."""
        return attention_scope(drafter, self.draft_attention)


def _static_choice(spec: DraftSpec, drafter) -> tuple[bool, str]:
    problem = static_cache_problem(drafter)
    if spec.static != AUTO:
        if spec.static and problem:
            raise ValueError(
                f"static=True cannot run on {type(drafter).__name__}: {problem}. Use cache_config={{'static': False}}"
            )
        return spec.static, "cache_config"
    if problem:
        return False, problem
    implementation = drafter.config._attn_implementation
    if implementation == "flex_attention" and getattr(drafter, "_supports_sdpa", False):
        # the same attention as its sdpa: a flex mask over a sparse cache's offset keys also fails to compile on CPU
        return (
            True,
            "the drafter runs flex_attention, which its model computes as sdpa too: fixed slot buffers read by "
            "budgetdraft_varlen",
        )
    if implementation not in SDPA_FAMILY:
        return False, f"the drafter runs {implementation!r}, not an sdpa-family attention"
    return True, "the drafter's layers allow fixed slot buffers read by budgetdraft_varlen"


def resolve_plan(
    spec: DraftSpec,
    cache_config: dict | None,
    target,
    drafter,
    call: GenerationConfig,
    batched: bool = False,
    loop_problem: str | None = None,
) -> DraftPlan:
    """Decide every `"auto"` of `spec` for this target, drafter and `generate()` config (`batched`: a call of
    several rows, whose draft caches are the ragged ones: never static, lean or compiled; `loop_problem`: what the
    call asks that the device round does not do), from the rules of the drafter's device (`device_rules.py`);
    `DraftPlan.reasons` says why each choice came out as it did."""
    rules = device_rules(drafter.device, drafter.dtype)
    window, window_reason = window_choice(spec, drafter, rules)
    spec = spec.replace(prefill_window=window)
    if batched:
        if True in (spec.static, spec.lean_step, spec.compile):
            raise ValueError(
                "static=True / lean_step=True / compile=True are single-sequence fast paths; a batch drafts on ragged "
                "per-row caches. Drop them from cache_config for batched calls"
            )
        spec = spec.replace(static=False, lean_step=False, compile=False)
    elif spec.full_draft_cache:
        raise ValueError(
            "full_draft_cache=True drafts in the batched loop; pass batched=True (generate() does)"
        )
    static, static_reason = _static_choice(spec, drafter)
    lean, lean_problem = lean_step_choice(spec.lean_step, static, drafter, rules)
    compiled, compile_config, compile_reason = compile_choice(
        spec, static, lean, drafter, call, rules, compiled_step_problem(drafter) if static else None
    )
    length, source, threshold, start = draft_length_choice(
        spec, "draft_length" in (cache_config or {}), call, drafter
    )
    # a threshold ends a draft early on a read of the device every step: transformers' loop does that
    if threshold and loop_problem is None:
        loop_problem = f"a confidence threshold ({threshold:g}) would read the device every draft step"
    device_round, round_reason = device_round_choice(spec, target, batched, rules, loop_problem)
    verify_config, verify_reason = verify_compile_choice(spec, device_round, target, call, rules)
    target_rules = device_rules(target.device, target.dtype)
    # the device round's target runs as loaded: its verification is compiled, not switched per call
    fast_verify = spec.fast_verify and not device_round
    target_linear = fast_verify and target_rules.few_row_linear and few_row_linear_applies(target)
    return DraftPlan(
        spec=spec.replace(
            static=static,
            lean_step=lean,
            compile=compiled,
            draft_length=length,
            device_round=device_round,
            compile_verify=verify_config is not None,
        ),
        draft_length_source=source,
        lean_step_problem=lean_problem,
        confidence_threshold=threshold,
        heuristic_start=start,
        draft_attention=VARLEN if static else None,
        target_attention=verify_attention(target, fast_verify),
        target_linear=target_linear,
        compile_config=compile_config if compiled else None,
        device_round=device_round,
        verify_compile_config=verify_config,
        coarse_verify_buckets=device_round and target_rules.coarse_verify_buckets,
        compiled_catch_up=rules.compiled_catch_up if compiled else 0,
        device_type=rules.device_type,
        batched=batched,
        reasons={
            "static": static_reason,
            "lean_step": lean_problem or asked_or(spec.lean_step, batched, rules.reasons["lean_step"]),
            "compile": compile_reason,
            "prefill_window": window_reason,
            "target_linear": target_rules.reasons["few_row_linear"]
            if fast_verify
            else ("the device round's target runs as loaded" if device_round else "fast_verify=False"),
            "draft_length": source,
            "device_round": round_reason,
            "compile_verify": verify_reason,
            "coarse_verify_buckets": target_rules.reasons["coarse_verify_buckets"]
            if device_round
            else "transformers' loop verifies",
            "round_clock": rules.reasons["round_clock"],
            "compiled_catch_up": rules.reasons["compiled_catch_up"],
        },
    )
