"""The draft's forward passes as step objects, chosen once per call from its plan (`DraftSteps.for_plan`).

Every step takes `feed (1, n)` token ids at `positions (1, n)` (and a padding mask where the row has one), writes
the draft cache as the drafter's own forward would, and returns the last position's logits `(1, V)` in float32:

- `ForwardStep`: a forward of the drafter (its own, or its compiled call) on the draft cache;
- `CompiledStep`: that forward compiled for one-token steps (CUDA graphs on CUDA), eager if compiling fails;
- `CheckedLeanStep`: the lean step (`cpu/lean_step.py`) for blocks of up to `slack` tokens, checked once against the
  drafter's own forward;
- `Prefill`: the drafter's prefill of the prompt, windowed (`cache/windowed_prefill.py`) or eager, capturing the
  queries a budgeted policy scores the prompt with, timed.
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass

import torch
from transformers.utils import logging

from ..attention.query_capture import query_capture
from ..cache import BudgetedCache, SparseDraftCache
from ..compat import cache_kwargs
from ..cpu import LeanDraftStep, same_logits
from . import draft_prefix, drafter_media
from .compile_lock import COMPILE_LOCK
from .compiled_call import compiled_call, module_guards_dropped
from .compiled_step import compiling_again_failed, cuda_graph_skips_so_far, dynamo_graphs_so_far
from .draft_length.clock import synchronize

logger = logging.get_logger(__name__)


class ForwardStep:
    """A forward of `model` (the drafter, or its compiled call) on its draft cache: the eager step, and what
    `CompiledStep` calls; inside `query_capture` when `capture_queries` (a cache that selects with each step's
    queries). `copy_out`: the logits are always a tensor of their own (a CUDA graph's output is overwritten by its
    next replay; float32 logits are copied, others are by their cast)."""

    def __init__(self, model, cache, capture_queries: bool = False, copy_out: bool = False):
        self.model, self.cache, self.capture_queries, self.copy_out = model, cache, capture_queries, copy_out

    @COMPILE_LOCK.shared()
    def __call__(self, feed, positions, mask=None) -> torch.Tensor:
        with query_capture(self.model) if self.capture_queries else contextlib.nullcontext():
            out = self.model(
                input_ids=feed,
                # an all-ones mask changes nothing, and its growing length would recompile a compiled step
                attention_mask=mask,
                position_ids=positions,
                **cache_kwargs(self.cache),
                use_cache=True,
                logits_to_keep=1,
            )
        logits = out.logits[:, -1, :]
        if logits.dtype != torch.float32:
            return logits.float()
        return logits.clone() if self.copy_out else logits


class CompiledStep:
    """The one-token step compiled with `compile_config` (`compiled_call.py`: for the drafter as it is when the call
    first steps, inside its drafting scope). Its first call compiles alone (`compile_lock.py`: one thread compiles,
    the others reuse its graph, and no thread runs a compiled forward meanwhile); if compiling fails it warns once
    and runs `fallback` from then on, unless the failed call already wrote to the cache. A static draft cache's step
    has fixed shapes, so a later step that compiles again means its inputs change from step to step: that step's
    result is kept and the rest of the call drafts on `fallback` (warned once), before the recompilations exhaust
    dynamo's limit for the process. Logits are copied out of the CUDA graph's memory, which the next replay
    overwrites."""

    def __init__(self, model, cache, compile_config, fallback: ForwardStep):
        self.model, self.cache, self.compile_config, self.fallback = model, cache, compile_config, fallback
        self.compiled: ForwardStep | None = None  # built by the first step
        self.checked, self.failure = False, None
        self.compiled_calls, self.eager_calls = 0, 0  # steps that ran compiled / eagerly after a failure
        # dynamo graphs compiled by this call's steps, and those of them after its first step
        self.graphs_compiled, self.recompiles = 0, 0
        self.cuda_graph_skips = 0  # graphs of its first step run without the CUDA graphs they asked for

    @property
    def failed(self) -> bool:
        return self.failure is not None

    def __call__(self, feed, positions, mask=None) -> torch.Tensor:
        if self.failed:
            self.eager_calls += 1
            return self.fallback(feed, positions)
        if not self.checked:
            return self._first(feed, positions)
        try:
            with COMPILE_LOCK.shared():
                graphs = dynamo_graphs_so_far()
                logits = self.compiled(feed, positions)
                new = dynamo_graphs_so_far() - graphs
        except compiling_again_failed() as error:  # raised compiling again, before the graph ran
            self._stop("compiling the draft step again failed", error=error)
            self.eager_calls += 1
            return self.fallback(feed, positions)
        self.compiled_calls += 1
        if new:
            self.graphs_compiled += new
            self.recompiles += new
            self._stop(
                "the compiled draft step recompiled",
                f"at call step {self.compiled_calls}: its inputs change from step to step",
            )
        return logits

    def _first(self, feed, positions) -> torch.Tensor:
        """The call's first compiled step: compiles (or reuses this process's graph); on any failure that wrote
        nothing to the cache (the one host read of its lengths), the eager step from then on."""
        lengths = self._static_lengths()
        try:
            with COMPILE_LOCK.alone():
                graphs, skips = dynamo_graphs_so_far(), cuda_graph_skips_so_far()
                compiled, _ = compiled_call(self.model, self.compile_config)
                self.compiled = ForwardStep(
                    functools.partial(compiled, self.model), self.cache, copy_out=True
                )
                logits = self.compiled(feed, positions)
                self.graphs_compiled += dynamo_graphs_so_far() - graphs
                self.cuda_graph_skips += cuda_graph_skips_so_far() - skips
        except Exception as error:  # any compiler failure; the eager step is the same computation
            if self._static_lengths() != lengths:
                raise
            self._stop("compiling the draft step failed", error=error)
            self.eager_calls += 1
            return self.fallback(feed, positions)
        self.compiled_calls += 1
        self.checked = True
        return logits

    def _stop(self, what: str, why: str = "", error: Exception | None = None) -> None:
        """Draft eagerly from now on: `what` happened (`why`, or the `error` raised), warned once."""
        self.failure = f"{type(error).__name__}: {error}" if error is not None else f"{what} {why}"
        logger.warning_once(
            f"{what} ({self.failure}); drafting eagerly instead. Pass cache_config={{'compile': False}} to skip "
            "the attempt."
        )
        if error is not None:
            logger.debug(what, exc_info=error)

    def _static_lengths(self) -> list[int]:
        return [
            int(layer.length)
            for layer in self.cache.layers
            if torch.is_tensor(getattr(layer, "length", None))
        ]


class CheckedLeanStep:
    """The lean step for blocks of up to `slack` tokens (longer ones run `fallback`). Its first block also runs the
    drafter's own forward (after rolling the lean step's write back) and it keeps running lean only if both gave the
    same logits."""

    def __init__(self, model, cache, slack: int, fallback: ForwardStep):
        self.lean, self.cache, self.slack, self.fallback = LeanDraftStep(model), cache, slack, fallback
        self.checked, self.failed = False, False

    @COMPILE_LOCK.shared()
    def __call__(self, feed, positions, mask=None) -> torch.Tensor:
        if self.failed or feed.shape[1] > self.slack:
            return self.fallback(feed, positions)
        logits = self.lean(feed, positions, self.cache)
        if self.checked:
            return logits.float()
        self.checked = True
        self.cache.crop(-feed.shape[1])
        reference = self.fallback(feed, positions)
        if not same_logits(logits, reference):
            logger.warning_once(
                f"the lean draft step and {type(self.fallback.model).__name__}'s own forward disagree (largest "
                f"logit difference {float((logits - reference).abs().max()):.3g}); drafting with the drafter's "
                "forward. Pass cache_config={'lean_step': False} to skip the check"
            )
            self.failed = True
        return reference


class Prefill:
    """The drafter's prefill of the prompt: in windowed chunks when the prompt is longer than `window` (then the
    draft cache is filled from the recorded keys/values through its layers' `update`), else its own forward,
    capturing the prefill's queries when `capture_queries`. In a call continuing a prefilled target cache, either
    runs on from where the prompt stops sharing the last one the drafter read (`draft_prefix`; a full prefill
    then records the keys/values in a `DynamicCache` first). A multimodal drafter given the prompt's images
    (`media`, `drafter_media.py`) reads them in one forward of its own, computing its own positions, and
    `rope_offset` says how far the later steps' positions run past their count. `seconds` accumulates its time
    (device synchronised)."""

    def __init__(
        self,
        eager: ForwardStep,
        window: int | None,
        num_sink_tokens: int,
        capture_queries: bool,
        media: dict | None = None,
    ):
        self.eager, self.window, self.num_sink_tokens = eager, window, num_sink_tokens
        self.capture_queries, self.seconds = capture_queries, 0.0
        self.media, self.rope_offset = media or {}, 0

    @COMPILE_LOCK.shared()
    def __call__(self, feed, positions, mask=None) -> torch.Tensor:
        start = time.perf_counter()
        model, cache = self.eager.model, self.eager.cache
        windowed = self.window is not None and feed.shape[1] > self.window and mask is None
        if self.media:
            logits = self._with_media(feed, mask)
        elif windowed or (mask is None and draft_prefix.continues_full_prefill(model, self.capture_queries)):
            window = self.window if windowed else None
            logits = draft_prefix.prefill_into(cache, model, feed, self.num_sink_tokens, window).float()
        else:
            with query_capture(model) if self.capture_queries else contextlib.nullcontext():
                logits = self.eager(feed, positions, mask)
        if isinstance(cache, SparseDraftCache):
            cache.drop_prompt_past()
        synchronize(feed.device)
        self.seconds += time.perf_counter() - start
        return logits

    def _with_media(self, feed, mask) -> torch.Tensor:
        model, cache = self.eager.model, self.eager.cache
        with query_capture(model) if self.capture_queries else contextlib.nullcontext():
            out = model(
                input_ids=feed,
                attention_mask=mask,
                **drafter_media.fitted(self.media, feed.shape[1]),
                **cache_kwargs(cache),
                use_cache=True,
                logits_to_keep=1,
            )
        self.rope_offset = drafter_media.rope_offset(model)
        return out.logits[:, -1, :].float()


@dataclass
class DraftSteps:
    """The steps of one call: `prefill`, `block` (several tokens), `token` (one), `eager` (a padded row); a block of
    up to `tokens_one_by_one` tokens goes through a compiled `token` step one token at a time instead (the device
    rules' `compiled_catch_up`)."""

    prefill: Prefill
    block: ForwardStep | CheckedLeanStep
    token: ForwardStep | CheckedLeanStep | CompiledStep
    eager: ForwardStep
    tokens_one_by_one: int = 0

    @classmethod
    def for_plan(cls, plan, model, cache, media: dict | None = None) -> DraftSteps:
        """The steps `plan` asks for, on `model` and its draft `cache` (whose budgeted policy, if it scores the prefix
        with the prefill's queries, makes the prefill capture them); `media`: the prompt's images for a multimodal
        drafter's prefill (`drafter_media.for_drafter`)."""
        spec = plan.spec
        budgeted = isinstance(cache, BudgetedCache)
        capture_queries = budgeted and cache.policy.needs_queries
        eager = ForwardStep(model, cache, capture_queries=budgeted and cache.policy.refreshes)
        block = CheckedLeanStep(model, cache, spec.slack, eager) if spec.lean_step else eager
        token = CompiledStep(model, cache, plan.compile_config, block) if spec.compile else block
        prefill = Prefill(eager, spec.prefill_window, spec.num_sink_tokens, capture_queries, media)
        return cls(
            prefill=prefill, block=block, token=token, eager=eager, tokens_one_by_one=plan.compiled_catch_up
        )

    @property
    def compiled(self) -> bool:
        """Whether one-token steps run compiled (False after a failed compilation)."""
        return isinstance(self.token, CompiledStep) and not self.token.failed

    def record(self) -> dict:
        """What the one-token step did in this call: planned compiled or not, steps run compiled, steps run
        eagerly after a failed compilation or a recompilation, dynamo graphs compiled by its steps and those
        after its first step (recompiles), those run without the CUDA graphs they asked for, whether its module
        guards were checked once per call, and why it stopped running compiled."""
        token = self.token
        if not isinstance(token, CompiledStep):
            return {
                "compiled": False,
                "compiled_calls": 0,
                "eager_calls": 0,
                "graphs_compiled": 0,
                "recompiles": 0,
                "cuda_graph_skips": 0,
                "module_guards_per_call": False,
                "failure": None,
            }
        return {
            "compiled": True,
            "compiled_calls": token.compiled_calls,
            "eager_calls": token.eager_calls,
            "graphs_compiled": token.graphs_compiled,
            "recompiles": token.recompiles,
            "cuda_graph_skips": token.cuda_graph_skips,
            "module_guards_per_call": module_guards_dropped(token.compile_config),
            "failure": token.failure,
        }

    def __call__(self, feed, past: int, mask: torch.Tensor | None) -> torch.Tensor:
        """Logits `(1, V)` after feeding `feed (1, n)` at positions `past ... past + n - 1`, past the prefill's
        `rope_offset` (`mask`: the padded row's attention mask, `None` without padding)."""
        start = past + self.prefill.rope_offset
        positions = torch.arange(start, start + feed.shape[1], device=feed.device)[None]
        if past == 0:
            return self.prefill(feed, positions, mask)
        if mask is not None:
            return self.eager(feed, positions, mask)
        if feed.shape[1] == 1:
            return self.token(feed, positions)
        if self.compiled and feed.shape[1] <= self.tokens_one_by_one:
            for k in range(feed.shape[1]):
                # copies with their own layout: a (1, 1) slice keeps the block's row stride, which a compiled step
                # would take for a new input and compile again
                token, position = (
                    t[:, k : k + 1].clone(memory_format=torch.contiguous_format) for t in (feed, positions)
                )
                logits = self.token(token, position)
            return logits
        return self.block(feed, positions)
