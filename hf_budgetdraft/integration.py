"""The one place that hooks into transformers' `generate()` (the releases it supports: `compat.py`).

`install()` (run by `import hf_budgetdraft`, idempotent) makes `cache_implementation="sink_window"` and
`"budgeted"` valid and wraps seven `GenerationMixin` steps:

- `_assisted_decoding`: a sparse-draft call resolves its `DraftSpec` (built from `cache_implementation` +
  `cache_config`) into a `DraftPlan` and runs inside it: the drafter on `budgetdraft_varlen` when its cache is
  static, the target verifying on `budgetdraft_sdpa` when it was loaded with `sdpa` and (float32 on CPU) on
  few-row linear layers — for that call only (`attention/scoped.py`, `cpu/few_row_linear.py`): the models are
  never written to, so calls in other threads on the same models are unaffected. A call continuing a prefilled
  target cache lets the drafter's prefill continue a prompt it read before (`generation/draft_prefix.py`).

- `_get_candidate_generator`: with `assistant_model=`, the named cache is the **draft's**; the assistant drafts
  through `SparseDraftCandidateGenerator` while the target keeps its full cache (lossless). With
  `use_mtp=True` and `"sink_window"`, the model's own MTP head drafts on a `WindowedMtpCache` (Windowed-MTP),
  a one-layer head only in the rounds the adaptive draft length picks, the target verifying as with a drafter;
  with `speculation_type="dflash"`, the DFlash block drafter on a `WindowedDFlashCache`.
  Inside `record_speculation()`, every candidate generator (stock ones too) is instrumented.
- `_prepare_cache_for_generation`: with a draft, the target's full cache is a `GrowableCache` (appends in place,
  exact O(1) rollback) when every layer is full attention, else transformers' default; without a draft, the
  target itself runs on the sparse cache (StreamingLLM-style, **lossy**: output can differ from full-cache greedy
  decoding).
- `prepare_inputs_for_generation`: a speculative call continuing a target cache passed to `generate()` (a prefix
  prefilled once), or prefilled in `prefill_chunk_size` chunks, feeds its first verification only the tokens that
  cache does not hold, and a prompt given as `inputs_embeds` with its drafts' embeddings after it
  (`generation/prefilled.py`).
- `_validate_generation_mode`: a sampling call drafting on a sparse cache may ask for `num_return_sequences > 1`
  (transformers refuses it for assisted calls): transformers repeats the prompts, the batched loop samples every
  copy and prefills each distinct prompt once.
- `_sample`: that lossy mode with a left-padded batch runs the ragged loop of `generation/batched_loop.py` with no
  draft, so each row's sink / selection is of its own tokens, not of the padding.
- `_maybe_prepare_encoder_kwargs_for_generation`: in a sparse-draft call, the raw images and videos the target
  encodes are kept for a multimodal drafter to encode with its own towers (`generation/drafter_media.py`).

`install()` also registers `attn_implementation="budgetdraft_sdpa"`, `"budgetdraft_varlen"` (varlen kernels on
GPU; the attention a `cache_config={"static": True}` draft cache needs) and the query-capture attentions.

Every other `generate()` call goes to transformers untouched.
"""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Callable
from contextlib import nullcontext
from contextvars import ContextVar

import transformers
from transformers import PreTrainedConfig
from transformers.generation import configuration_utils
from transformers.generation.utils import GenerationMixin, GenerationMode
from transformers.utils import logging

from .attention.fast_sdpa import register as register_fast_sdpa
from .attention.query_capture import CAPTURE_PREFIX
from .attention.query_capture import register as register_query_capture
from .attention.scoped import install as install_scoped_attention
from .attention.scoped import uninstall as uninstall_scoped_attention
from .attention.scoped import using_attention
from .attention.varlen import register as register_varlen
from .cache import GrowableCache, SparseDraftCache, is_full_attention_only
from .cache.sizes import MAX_CACHE_TOKENS
from .compat import CACHE_KWARG, TESTED, installed_is_tested, patch_point_problems, refusal
from .cpu import few_row_linears
from .cpu.few_row_linear import uninstall as uninstall_few_row_linears
from .generation import drafter_media
from .generation.batched_loop import run_batched, run_sparse_batch
from .generation.cache_config import WindowedSpec
from .generation.candidate_generator import SparseDraftCandidateGenerator
from .generation.device_loop import run_device_round
from .generation.device_loop import unsupported as unsupported_by_device_round
from .generation.dflash import windowed_dflash_cache
from .generation.draft_prefix import reusing_read_prompts
from .generation.model_inputs import uncarried_inputs
from .generation.mtp_heads import expose_mtp_layers
from .generation.other_tokenizer import OtherTokenizerDraftGenerator
from .generation.plan import DraftPlan, resolve_plan, verify_attention
from .generation.prefilled import (
    check_target_cache,
    continues_a_prefix,
    continuing,
    first_round_inputs,
    kept_on_failure,
)
from .generation.processors import refuse_stateful
from .generation.spec import CACHE_CLASSES, DraftSpec
from .generation.stats import active_recorder, instrument
from .generation.stops import EveryTokenStops
from .generation.windowed_assistant import WindowedAssistantCandidateGenerator, is_shared_kv_assistant
from .generation.windowed_mtp import windowed_mtp_generator

logger = logging.get_logger(__name__)
SPARSE_CACHE_IMPLEMENTATIONS: dict[str, type[SparseDraftCache]] = CACHE_CLASSES

# a method install() put on GenerationMixin carries, under this name, the one it replaced (uninstall() puts it back)
REPLACED = "__budgetdraft_replaces__"
_current_plan: ContextVar[DraftPlan | None] = ContextVar("budgetdraft_draft_plan", default=None)


def build_sparse_cache(name: str, config: PreTrainedConfig, cache_config: dict | None) -> SparseDraftCache:
    """Build the cache named by `cache_implementation` from `generate()`'s `cache_config` dict (a `DraftSpec`'s
    options; an unresolved `static="auto"` means dynamic here)."""
    return DraftSpec.from_cache_config(name, cache_config).build_cache(config)


def _check_assistant(
    target, assistant_model, generation_config, assistant_tokenizer, rows: int | None = None
) -> None:
    name = generation_config.cache_implementation
    if generation_config.prompt_lookup_num_tokens is not None or assistant_model is None:
        raise ValueError(
            f"cache_implementation={name!r} names the draft model's cache, but this call has no draft model "
            "(assistant_model=None); pass assistant_model=drafter"
        )
    _check_devices(target, assistant_model)
    # `tokenizer=` alone is what `stop_strings` needs; with `assistant_tokenizer=` too, transformers runs universal
    # assisted generation (a drafter with another tokenizer: `generation/other_tokenizer.py`)
    if assistant_tokenizer is not None:
        _check_other_tokenizer(generation_config, rows)
        return
    # transformers itself refuses most mismatches first ("different tokenizers"); this also covers the rest
    target_vocab = target.config.get_text_config().vocab_size
    draft_vocab = assistant_model.config.get_text_config().vocab_size
    if target_vocab != draft_vocab:
        raise ValueError(
            f"drafter vocab_size={draft_vocab} differs from the target's vocab_size={target_vocab}; the drafter "
            "must share the target's tokenizer and vocabulary, or pass tokenizer= and assistant_tokenizer= (a "
            "drafter with another tokenizer)"
        )


def _check_other_tokenizer(generation_config, rows: int | None) -> None:
    """What a drafter with another tokenizer supports here: calls of one sequence."""
    name = generation_config.cache_implementation
    if rows is not None and rows > 1:
        raise ValueError(
            f"a drafter with another tokenizer (assistant_tokenizer=) drafts one sequence at a time (it translates "
            f"each round through text), got {rows} rows; generate them one by one"
        )
    full = DraftSpec.from_cache_config(name, generation_config.cache_config).full_draft_cache
    if full:
        raise ValueError(
            "full_draft_cache=True runs the batched loop, which drafts in the target's tokens; drop it with "
            "assistant_tokenizer="
        )


def _check_prompt(target, input_ids, embeds) -> None:
    """Refuse a prompt a speculative call cannot start from: empty, given as `inputs_embeds` alone, or past the
    position limit of a target whose positions are a learned table. Past a RoPE target's `max_position_embeddings`
    the call runs (the rotations are defined at any position; the output is still exactly the target's) and says so
    once."""
    if input_ids is None:
        return
    length = input_ids.shape[-1]
    if length == 0 and embeds is not None:
        raise ValueError(
            f"the prompt came as inputs_embeds {tuple(embeds.shape)} without its token ids; a speculative call's "
            "drafter reads the prompt's ids (its own embeddings): pass input_ids= too (the target still reads "
            "inputs_embeds)"
        )
    if length == 0:
        raise ValueError(
            f"the prompt is empty (input_ids of shape {tuple(input_ids.shape)}); speculative decoding continues a "
            "prompt of at least one token: pass the tokenizer's BOS token (or any prefix) as the prompt"
        )
    config = target.config.get_text_config(decoder=True)
    limit = getattr(config, "max_position_embeddings", None)
    if not isinstance(limit, int) or length <= limit:
        return
    if getattr(config, "rope_parameters", None) is None:
        raise ValueError(
            f"the prompt has {length} tokens, more than the target's max_position_embeddings={limit} (a learned "
            "position table); truncate the prompt (keep its last tokens) or use a target made for longer inputs"
        )
    logger.warning_once(
        f"the prompt has {length} tokens, more than the target's max_position_embeddings={limit}: its RoPE runs past "
        "the positions it was trained on. The output is still exactly the target's; its quality there is the target's"
    )


def _check_devices(target, assistant_model) -> None:
    """The target and the drafter run on one device (their dtypes may differ: the draft's logits are compared in
    float32). A target accelerate offloads in part (weights on the meta device, brought in by hooks) runs; one whose
    first weights are offloaded reports the meta device, where transformers' assisted loop puts its tensors."""
    if assistant_model is None:
        return
    if target.device.type == "meta":
        raise ValueError(
            "the target's first weights are on the meta device (offloaded by accelerate: cpu_offload, disk_offload, "
            "or a device_map that offloads its embeddings), and speculative decoding places its tensors on "
            "target.device: keep the embeddings on the device it computes on (a device_map with 'model.embed_tokens' "
            "there; later layers may be offloaded), or load the target whole on that device"
        )
    if assistant_model.device != target.device:
        raise ValueError(
            f"the target is on {target.device} and the drafter on {assistant_model.device}; speculative decoding "
            f"runs both on one device: move the drafter with drafter.to({str(target.device)!r})"
        )


def _windowed_builtin_generator(self, name, generation_config, assistant_model, stock_generator):
    """transformers' own MTP (`use_mtp=True`) or DFlash (`speculation_type="dflash"`) candidate generator, built by
    `stock_generator(**kwargs)`, with its draft cache swapped for a sink + window ring (Windowed-MTP)."""
    mtp = generation_config.use_mtp
    kind, draft = ("use_mtp=True", "MTP") if mtp else ("speculation_type='dflash'", "DFlash")
    if name != "sink_window":
        raise ValueError(
            f"{kind} supports cache_implementation='sink_window' (a windowed {draft} draft), got {name!r}; a budgeted "
            f"{draft} cache is not implemented"
        )
    if mtp:
        if not getattr(self.config.get_text_config(), "num_mtp_layers", None):
            raise ValueError(
                f"use_mtp=True needs a model with MTP layers (config.num_mtp_layers), but {type(self).__name__} has "
                "none"
            )
        spec = WindowedSpec.from_cache_config("mtp", generation_config.cache_config)
        expose_mtp_layers(self)
        return windowed_mtp_generator(self, stock_generator(), spec)
    if assistant_model is None:
        raise ValueError("speculation_type='dflash' needs assistant_model=<a DFlash drafter>")
    spec = WindowedSpec.from_cache_config("dflash", generation_config.cache_config)
    generator = stock_generator(assistant_model=assistant_model)
    generator.cache = windowed_dflash_cache(assistant_model, spec)
    return generator


def _get_candidate_generator(
    stock,
    self,
    generation_config,
    input_ids,
    inputs_tensor,
    logits_processor,
    model_kwargs,
    assistant_model=None,
    target_tokenizer=None,
    assistant_tokenizer=None,
):
    name = generation_config.cache_implementation
    stock_generator = functools.partial(
        stock,
        self,
        generation_config,
        input_ids,
        inputs_tensor,
        logits_processor,
        model_kwargs,
    )
    builtin_draft = generation_config.use_mtp or generation_config.speculation_type == "dflash"
    if name in SPARSE_CACHE_IMPLEMENTATIONS and is_shared_kv_assistant(assistant_model):
        generator = WindowedAssistantCandidateGenerator.for_call(self, assistant_model, generation_config)
    elif name in SPARSE_CACHE_IMPLEMENTATIONS and builtin_draft:
        generator = _windowed_builtin_generator(
            self, name, generation_config, assistant_model, stock_generator
        )
    elif name in SPARSE_CACHE_IMPLEMENTATIONS:
        plan = _current_plan.get()
        if plan is None:  # reached without generate(): resolve here (no attention switch)
            _check_assistant(self, assistant_model, generation_config, assistant_tokenizer)
            plan = _plan(self, assistant_model, generation_config)
        arguments = dict(
            input_ids=input_ids,
            assistant_model=assistant_model,
            generation_config=generation_config,
            model_kwargs=model_kwargs,
            draft_cache=plan.draft_cache(assistant_model),
            plan=plan,
            inputs_tensor=inputs_tensor,
            logits_processor=logits_processor,
        )
        if assistant_tokenizer is None:
            generator = SparseDraftCandidateGenerator(**arguments)
        else:  # transformers refuses assistant_tokenizer= without tokenizer=
            generator = OtherTokenizerDraftGenerator(
                **arguments,
                target_tokenizer=target_tokenizer,
                assistant_tokenizer=assistant_tokenizer,
                target_vocab_size=self.config.get_text_config().vocab_size,
            )
    else:
        generator = stock_generator(
            assistant_model=assistant_model,
            target_tokenizer=target_tokenizer,
            assistant_tokenizer=assistant_tokenizer,
        )
    stats = active_recorder()
    if stats is not None:
        instrument(generator, stats)
    return generator


def _plan(
    target, assistant_model, generation_config, rows: int | None = None, loop_problem: str | None = None
) -> DraftPlan:
    """The call's plan; `rows` (the batch size, `None`: unknown, one sequence) decides whether it runs batched,
    `loop_problem` (what the call asks that the device round does not do) whether it may run the device round."""
    name, cache_config = generation_config.cache_implementation, generation_config.cache_config
    spec = DraftSpec.from_cache_config(name, cache_config)
    batched = rows is not None and spec.runs_batched(rows)
    return resolve_plan(
        spec,
        cache_config,
        target,
        assistant_model,
        generation_config,
        batched=batched,
        loop_problem=loop_problem,
    )


def _assisted_decoding(stock, self, *args, **kwargs):
    """Sparse-draft calls run inside their `DraftPlan`, scoped to this call (the models are not written to). A batch of
    more than one row, or a call drafting on a full cache (`cache_config={"full_draft_cache": True}`), runs the batched
    loop (`generation/batched_loop.py`)."""
    try:
        return _assisted(stock, self, *args, **kwargs)
    finally:
        drafter_media.forget()  # the call's images, kept for its drafter's prefill


def _assisted(stock, self, *args, **kwargs):
    generation_config = kwargs.get("generation_config")
    assistant_model = kwargs.get("assistant_model")
    input_ids = args[0] if args else kwargs.get("input_ids")
    builtin_draft = generation_config is not None and (
        generation_config.use_mtp or generation_config.speculation_type == "dflash"
    )
    sparse = (
        generation_config is not None
        and generation_config.cache_implementation in SPARSE_CACHE_IMPLEMENTATIONS
    )
    if sparse:
        _check_prompt(self, input_ids, kwargs.get("inputs_embeds"))
        refuse_stateful(
            kwargs.get("logits_processor"), f"cache_implementation={generation_config.cache_implementation!r}"
        )
    if sparse and builtin_draft and input_ids is not None and input_ids.shape[0] > 1:
        raise ValueError(
            f"use_mtp=True / speculation_type='dflash' with cache_implementation="
            f"{generation_config.cache_implementation!r} drafts one sequence at a time (transformers' MTP and DFlash "
            f"loops are single-sequence); got a batch of {input_ids.shape[0]}. Generate the rows one by one, or draft "
            "with assistant_model= (batched)"
        )
    if sparse and generation_config.use_mtp:  # windowed MTP: the target verifies as with assistant_model=
        fast_verify = WindowedSpec.from_cache_config("mtp", generation_config.cache_config).fast_verify
        with using_attention(self, verify_attention(self, fast_verify)), few_row_linears(self, fast_verify):
            return _every_token_stops(stock, self, input_ids, args, kwargs)
    if not sparse:
        return stock(self, *args, **kwargs)
    if is_shared_kv_assistant(assistant_model):
        return _windowed_assistant(stock, self, generation_config, input_ids, args, kwargs)
    if builtin_draft:
        return _every_token_stops(stock, self, input_ids, args, kwargs)
    rows = None if input_ids is None else input_ids.shape[0]
    other_tokenizer = kwargs.get("assistant_tokenizer")
    _check_assistant(self, assistant_model, generation_config, other_tokenizer, rows)
    loop_problem = unsupported_by_device_round(self, generation_config, kwargs, input_ids)
    if other_tokenizer is not None:
        loop_problem = "a drafter with another tokenizer, translated through text on the host every round"
    plan = _plan(self, assistant_model, generation_config, rows, loop_problem)
    stats = active_recorder()
    if stats is not None:
        stats.plan = plan
    cache = kwargs.get(CACHE_KWARG)
    # a call continuing a prefilled target cache: the drafter continues a prompt it read before, where it can
    with reusing_read_prompts() if continues_a_prefix(cache) else nullcontext():
        if plan.batched:
            with plan.applied(self):
                return run_batched(self, assistant_model, plan, input_ids, generation_config, kwargs)
        if plan.device_round:
            return run_device_round(self, assistant_model, plan, input_ids, generation_config, kwargs, stats)
        return _single_sequence(stock, self, plan, generation_config, input_ids, args, kwargs)


def _windowed_assistant(stock, self, generation_config, input_ids, args, kwargs):
    """A Gemma 4 assistant reading a sink + window or a budget + window of the target's full-attention states
    (`generation/windowed_assistant.py`): transformers' loop, its generator built in `_get_candidate_generator`."""
    # its keys, checked before any forward
    WindowedSpec.from_cache_config(
        f"assistant_{generation_config.cache_implementation}", generation_config.cache_config
    )
    if not type(self).__name__.startswith(("Gemma4", "Gemma3n")):
        raise ValueError(
            f"a Gemma 4 assistant drafts from the shared_kv_states of a Gemma 4 or Gemma 3n target, got "
            f"{type(self).__name__}"
        )
    mask = kwargs.get("attention_mask")
    padded = mask is not None and not bool(mask.all())
    if input_ids.shape[0] > 1 or padded:
        raise ValueError(
            f"a Gemma 4 assistant on cache_implementation={generation_config.cache_implementation!r} drafts one "
            "unpadded sequence at a time (transformers' assistant loop "
            f"does), got {input_ids.shape[0]} rows{' with padding' if padded else ''}; generate the rows one by one"
        )
    return _every_token_stops(stock, self, input_ids, args, kwargs)


def _single_sequence(stock, self, plan, generation_config, input_ids, args, kwargs):
    """transformers' assisted loop inside the call's plan, its first verification in `continuing`'s scope."""
    token = _current_plan.set(plan)
    cache, mask = kwargs.get(CACHE_KWARG), kwargs.get("attention_mask")
    # transformers' prefill_chunk_size, which its assisted loop ignores (a padded row keeps the one-forward prefill)
    chunk = generation_config.prefill_chunk_size if mask is None or bool(mask.all()) else None
    extra = uncarried_inputs(kwargs, input_ids) if chunk is not None else []
    if extra:
        logger.warning_once(
            f"prefill_chunk_size is not applied to a speculative call whose model inputs include {extra} (the chunks "
            "would be fed without them): the prompt is verified in one forward, as transformers' assisted loop does"
        )
        chunk = None
    try:
        with (
            kept_on_failure(cache),
            plan.applied(self),
            continuing(self, cache, input_ids, chunk, kwargs.get("inputs_embeds"))
            if cache is not None
            else nullcontext(),
        ):
            return _every_token_stops(stock, self, input_ids, args, kwargs)
    finally:
        _current_plan.reset(token)


def _every_token_stops(stock, self, input_ids, args, kwargs):
    """transformers' assisted loop, its stopping criteria besides `max_length` and EOS checked at every token of a
    round rather than at the round's end (`generation/stops.py`), so the output stops where the target's would."""
    stops = EveryTokenStops.wrap(kwargs, input_ids)
    output = stock(self, *args, **kwargs)
    return output if stops is None else stops.trim(output, kwargs.get(CACHE_KWARG))


def _prepare_cache_for_generation(
    stock, self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
):
    name = generation_config.cache_implementation
    speculating = (
        name in SPARSE_CACHE_IMPLEMENTATIONS and generation_mode == GenerationMode.ASSISTED_GENERATION
    )
    given = model_kwargs.get(CACHE_KWARG)
    if speculating and given is not None:
        _keep_given_cache(given, generation_config, batch_size)
        return
    if speculating and _can_use_growable(self, generation_config):
        # with a draft, the target keeps a full cache (only the draft's is sparse), sized for the whole call
        # (prompt + max_new_tokens): appends in place, never grows unless the call overshoots
        capacity = min(max(1, max_cache_length), MAX_CACHE_TOKENS)
        model_kwargs[CACHE_KWARG] = GrowableCache(config=self.config, initial_capacity=capacity)
        return
    if name not in SPARSE_CACHE_IMPLEMENTATIONS or generation_mode == GenerationMode.ASSISTED_GENERATION:
        return stock(self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length)
    if model_kwargs.get(CACHE_KWARG) is not None:
        raise ValueError(f"pass either cache_implementation= or {CACHE_KWARG}=, not both")
    cache = build_sparse_cache(name, self.config, generation_config.cache_config)
    policy = getattr(cache, "policy", None)
    if (
        policy is not None
        and policy.reads_queries
        and not self.config._attn_implementation.startswith(CAPTURE_PREFIX)
    ):
        raise ValueError(
            f"policy={policy.name!r} scores the prefix with queries (the prefill's, or each step's); without a "
            "draft, run the call inside `with hf_budgetdraft.query_capture(model):`"
        )
    model_kwargs[CACHE_KWARG] = cache


def _keep_given_cache(cache, generation_config, rows: int) -> None:
    """A speculative call continues the target cache its caller passed (`generation/prefilled.py`), marked as
    transformers marks a caller's cache (returned, never freed)."""
    if generation_config.use_mtp or generation_config.speculation_type == "dflash":
        raise ValueError(
            f"use_mtp=True / speculation_type='dflash' with cache_implementation="
            f"{generation_config.cache_implementation!r} builds the target's cache itself; drop cache= (pass the "
            "whole prompt), or draft with assistant_model=, which continues a cache passed to generate()"
        )
    spec = DraftSpec.from_cache_config(generation_config.cache_implementation, generation_config.cache_config)
    copies = generation_config.num_return_sequences or 1  # transformers repeats each prompt that many times
    check_target_cache(cache, rows * copies, spec.runs_batched(rows * copies), copies)
    cache._is_user_defined = True


def prepare_inputs_for_generation(stock, self, input_ids, *args, **kwargs):
    """transformers' own, except in a speculative call continuing a prefilled target cache, whose first
    verification feeds only the tokens the cache does not hold (`generation/prefilled.py`)."""
    first_round_inputs(input_ids, kwargs)
    return stock(self, input_ids, *args, **kwargs)


def _maybe_prepare_encoder_kwargs_for_generation(
    stock, self, inputs_tensor, model_kwargs, model_input_name, generation_config
):
    """transformers' own (the target encodes the prompt's images); a sparse-draft call keeps the raw inputs it
    encoded, for a multimodal drafter to encode with its own towers (`generation/drafter_media.py`)."""
    if generation_config.cache_implementation not in SPARSE_CACHE_IMPLEMENTATIONS:
        return stock(self, inputs_tensor, model_kwargs, model_input_name, generation_config)
    before = dict(model_kwargs)
    model_kwargs = stock(self, inputs_tensor, model_kwargs, model_input_name, generation_config)
    drafter_media.keep(before, model_kwargs)
    return model_kwargs


def _sample(stock, self, *args, **kwargs):
    """Greedy/sampling on a sparse cache without a draft (lossy): a left-padded batch runs the ragged loop, so each
    row keeps its own sink + window or selection of its own tokens (not of the padding)."""
    drafter_media.forget()  # nothing drafts
    generation_config = kwargs.get("generation_config")
    input_ids = args[0] if args else kwargs.get("input_ids")
    mask = kwargs.get("attention_mask")
    name = getattr(generation_config, "cache_implementation", None)
    if name in SPARSE_CACHE_IMPLEMENTATIONS and mask is not None and not bool(mask.all()):
        spec = DraftSpec.from_cache_config(name, generation_config.cache_config)
        return run_sparse_batch(self, spec, input_ids, generation_config, kwargs)
    return stock(self, *args, **kwargs)


def _validate_generation_mode(stock, self, generation_mode, generation_config, generation_mode_kwargs):
    """transformers' checks, except that a sampling call drafting on a sparse cache may ask for
    `num_return_sequences > 1`: transformers repeats each prompt that many times and the batched loop samples every
    copy on its own, prefilling each distinct prompt once."""
    if _samples_several(generation_mode, generation_config, generation_mode_kwargs):
        generation_config = copy.copy(
            generation_config
        )  # the call's own config keeps its count for the expansion
        generation_config.num_return_sequences = 1
    return stock(self, generation_mode, generation_config, generation_mode_kwargs)


def _samples_several(generation_mode, generation_config, generation_mode_kwargs) -> bool:
    return (
        generation_mode == GenerationMode.ASSISTED_GENERATION
        and generation_config.cache_implementation in SPARSE_CACHE_IMPLEMENTATIONS
        and bool(generation_config.do_sample)
        and (generation_config.num_return_sequences or 1) > 1
        and generation_mode_kwargs.get("assistant_model") is not None
        and not (generation_config.use_mtp or generation_config.speculation_type == "dflash")
    )


def _can_use_growable(model, generation_config) -> bool:
    """The target's full cache is a `GrowableCache` (in-place appends, O(1) crop) when nothing asks otherwise (a
    cache the caller passed is kept before this is asked)."""
    windowed_mtp_fast = (
        generation_config.use_mtp
        and WindowedSpec.from_cache_config("mtp", generation_config.cache_config).fast_verify
    )
    return (
        # windowed DFlash keeps the target cache native DFlash uses; windowed MTP too with fast_verify=False
        (windowed_mtp_fast or not generation_config.use_mtp)
        and generation_config.speculation_type != "dflash"
        and generation_config.use_cache is not False
        and not model.config.is_encoder_decoder
        and model._supports_default_dynamic_cache()
        and is_full_attention_only(model.config)
    )


def _refusing_generate(message: str):
    """The step that stands in for `GenerationMixin.generate` where a patch point is missing: calls naming a sparse
    draft cache are refused with `message`, the others go to transformers' own `generate` (`stock`) untouched."""

    def generate(stock, self, *args, **kwargs):
        config = kwargs.get("generation_config") or getattr(self, "generation_config", None)
        name = kwargs.get("cache_implementation", getattr(config, "cache_implementation", None))
        if name in SPARSE_CACHE_IMPLEMENTATIONS:
            raise RuntimeError(message)
        return stock(self, *args, **kwargs)

    return generate


STEPS = (
    _maybe_prepare_encoder_kwargs_for_generation,
    _get_candidate_generator,
    _prepare_cache_for_generation,
    _assisted_decoding,
    _sample,
    prepare_inputs_for_generation,
    _validate_generation_mode,
)


def _replacing(step: Callable, stock: Callable) -> Callable:
    """`step` as the `GenerationMixin` method in place of `stock`, which it receives first; the method carries
    `stock` (under `REPLACED`) and its signature (`generate()` reads a decoding method's parameters)."""

    def method(self, *args, **kwargs):
        return step(stock, self, *args, **kwargs)

    method.__name__ = method.__qualname__ = stock.__name__
    method.__doc__ = step.__doc__ or stock.__doc__
    method.__signature__ = inspect.signature(stock)
    setattr(method, REPLACED, stock)
    return method


def _replace(name: str, step: Callable) -> None:
    setattr(GenerationMixin, name, _replacing(step, getattr(GenerationMixin, name)))


def _installed() -> bool:
    return any(hasattr(GenerationMixin.__dict__.get(name), REPLACED) for name in ("generate", "_sample"))


def uninstall() -> None:
    """Undo `install()`: transformers' own `generate()` steps, its list of cache names, the config's attention
    property and `nn.Linear.forward` as they were (the attention functions stay registered under their own names,
    unused). `install()` can run again after it."""
    if not _installed():
        return
    for name in ("generate", *(step.__name__ for step in STEPS)):
        if hasattr(method := GenerationMixin.__dict__.get(name), REPLACED):
            setattr(GenerationMixin, name, getattr(method, REPLACED))
    names = configuration_utils.ALL_CACHE_IMPLEMENTATIONS  # ours only: transformers has no such names
    configuration_utils.ALL_CACHE_IMPLEMENTATIONS = type(names)(
        n for n in names if n not in SPARSE_CACHE_IMPLEMENTATIONS
    )
    uninstall_scoped_attention()
    uninstall_few_row_linears()


def install() -> None:
    """Register the sparse cache implementations with transformers' `generate()` (idempotent). On a transformers
    that lacks a patch point (`compat.patch_point_problems()`), calls naming a sparse cache are refused instead."""
    if _installed():
        return
    problems = patch_point_problems()
    if problems:
        _replace("generate", _refusing_generate(refusal(problems)))
        logger.warning(refusal(problems))
        return
    if not installed_is_tested():
        logger.warning(
            f"hf-budgetdraft is tested with transformers {TESTED[0]} to {TESTED[1]}, not {transformers.__version__}; "
            "every patch point it relies on is there, so speculative calls run, untested "
            "(scripts/check_release.sh transformers VERSION checks one)"
        )
    install_scoped_attention()
    register_query_capture()
    register_fast_sdpa()
    register_varlen()
    missing = tuple(
        n for n in SPARSE_CACHE_IMPLEMENTATIONS if n not in configuration_utils.ALL_CACHE_IMPLEMENTATIONS
    )
    configuration_utils.ALL_CACHE_IMPLEMENTATIONS += missing
    for step in STEPS:
        _replace(step.__name__, step)
