"""Assisted generation whose assistant drafts on a sparse KV cache while the target keeps its full cache."""

from __future__ import annotations

import contextlib
import threading
import time

import torch
from transformers.generation.candidate_generator import AssistedCandidateGenerator
from transformers.utils import logging

from ..attention.query_capture import query_capture
from ..cache import BudgetedCache, SparseDraftCache
from ..cache.windowed_prefill import fill_from_prefix, windowed_prefill
from ..compat import CACHE_KWARG, activate_past_recording, cache_kwargs, prepare_draft_inputs
from .draft_length import (
    AdaptiveDraftLength,
    DraftLength,
    FixedDraftLength,
    HeuristicDraftLength,
    RoundClock,
)
from .fast_path import DraftPlan, record_eager_steps
from .lean_step import LeanDraftStep, same_logits

logger = logging.get_logger(__name__)
_first_compiled_call = threading.Lock()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_draft_length(plan: DraftPlan) -> DraftLength:
    """The draft-length policy a plan names."""
    length, maximum = plan.spec.draft_length, plan.spec.max_draft_length
    if length == "adaptive":
        return AdaptiveDraftLength(maximum=maximum)
    if length == "heuristic":
        return HeuristicDraftLength(length=plan.heuristic_start, maximum=maximum)
    return FixedDraftLength(length=int(length))


class SparseDraftCandidateGenerator(AssistedCandidateGenerator):
    """`AssistedCandidateGenerator` with the assistant's cache replaced by a `SparseDraftCache`.

    Only the draft reads the sparse cache; the target verifies every candidate on its own full cache, so greedy
    output equals the target's greedy output and sampling keeps the target's distribution (the candidate logits
    returned are the processed draft distribution the tokens were sampled from, as speculative sampling needs).
    Each round drafts the length its `DraftLength` policy picks (0: the target takes a plain AR step); the draft
    cache is rolled back over the rejected tail with `crop(-n)`, never re-prefilled.
    """

    def __init__(
        self,
        input_ids: torch.LongTensor,
        assistant_model,
        generation_config,
        model_kwargs: dict,
        draft_cache: SparseDraftCache,
        plan: DraftPlan,
        inputs_tensor: torch.Tensor | None = None,
        logits_processor=None,
    ):
        super().__init__(
            input_ids, assistant_model, generation_config, model_kwargs, inputs_tensor, logits_processor
        )
        activate_past_recording(draft_cache)  # sliding-window layers (if any) must be able to roll back too
        # the draft's own generate() (nested, for batches) is handed the draft cache itself, never a cache name
        # (transformers resets it from 5.24 on)
        self.generation_config.cache_implementation = None
        self.draft_cache = draft_cache
        self.assistant_kwargs[CACHE_KWARG] = draft_cache
        self.plan = plan
        self.draft_length = make_draft_length(plan)
        self.clock = RoundClock(self.draft_length, assistant_model.device)
        policy = getattr(draft_cache, "policy", None)
        self._capture_prefill_queries = isinstance(draft_cache, BudgetedCache) and policy.needs_queries
        self._compiled = plan.spec.compile
        self._draft_step = (
            assistant_model.get_compiled_call(plan.compile_config) if self._compiled else assistant_model
        )
        self._compile_checked = False
        self._lean = LeanDraftStep(assistant_model) if plan.spec.lean_step else None
        self._lean_checked = False
        self._drafting = plan.drafting(assistant_model)
        self.draft_prefill_seconds = 0.0
        # tokens the draft cache holds, kept on the host: a static cache's own count is a device tensor, and
        # reading it would cost a device synchronisation twice a round (None: unknown, read the cache)
        self.seen_tokens: int | None = 0

    # -- a round -------------------------------------------------------------------------------------------------
    def get_candidates(
        self, input_ids: torch.LongTensor, **kwargs
    ) -> tuple[torch.LongTensor, torch.Tensor | None]:
        """Draft this round's tokens: `(candidate_ids (1, L + n), candidate_logits (1, n, V) or None)`, n >= 0."""
        self.clock.start()
        self.num_assistant_tokens = self.draft_length.next_length()
        candidates, logits = input_ids, None
        if self.num_assistant_tokens > 0:
            with self._drafting():
                candidates, logits = super().get_candidates(input_ids)
        self.clock.drafted(candidates.shape[-1] - input_ids.shape[-1])
        return candidates, logits

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int):
        self.clock.finish(int(num_matches))
        if self.clock.drafted_tokens and self.plan.spec.static and not self._compiled:
            record_eager_steps(self.assistant_model, self.clock.draft_seconds)

    def _update_past_and_masks(self, input_ids: torch.LongTensor, *args, **kwargs) -> bool:
        """Roll back exactly the rejected draft tokens, so the cache holds tokens `[0, L - 1)` of `input_ids (1, L)`
        and only the newest token is fed. transformers' own step (whose arguments change between releases) can also
        re-feed the last accepted token, which would roll back into a budgeted cache's compressed prefix right after
        the prefill."""
        cache = self.assistant_kwargs.get(CACHE_KWARG)
        if cache is None:
            return False
        seen = self.seen_tokens if self.seen_tokens is not None else int(cache.get_seq_length())
        excess = seen - (input_ids.shape[-1] - 1)
        if excess >= 0:
            cache.crop(-excess)
            if self.seen_tokens is not None:
                self.seen_tokens = seen - excess
        self.assistant_kwargs = prepare_draft_inputs(
            self.assistant_kwargs, input_ids.shape[-1], self.assistant_model.config.is_encoder_decoder
        )
        return True

    def _generate_candidates(self, generation_args: dict):
        if generation_args[self.input_ids_key].shape[0] != 1:  # batches keep the nested assistant generate()
            self.seen_tokens = None
            return super()._generate_candidates(generation_args)
        return self._draft(generation_args)

    # -- the draft loop ------------------------------------------------------------------------------------------
    def _forward(
        self, feed: torch.LongTensor, past: int, mask: torch.Tensor | None, padded: bool, prefill: bool
    ) -> torch.Tensor:
        """Next-token logits `(1, V)` after feeding `feed` `(1, n)` at positions `past..past + n - 1`
        (`prefill`: the draft cache was empty; the drafter's prefill is timed)."""
        one_token = feed.shape[1] == 1 and not padded
        lean = self._lean is not None and feed.shape[1] <= self.plan.spec.slack
        if lean and not (prefill or padded or (one_token and self._compiled)):
            return self._lean_forward(feed, past)
        forward = self._draft_step if one_token else self.assistant_model
        start = time.perf_counter() if prefill else 0.0
        window = self.plan.spec.prefill_window
        if prefill and window is not None and feed.shape[1] > window and not padded:
            logits = self._windowed_prefill(feed, window)
            _synchronize(feed.device)
            self.draft_prefill_seconds += time.perf_counter() - start
            return logits
        inputs = {
            "input_ids": feed,
            # an all-ones mask changes nothing, and its growing length would recompile a compiled step
            "attention_mask": mask if padded else None,
            "position_ids": torch.arange(past, past + feed.shape[1], device=feed.device)[None],
            **cache_kwargs(self.draft_cache),
            "use_cache": True,
            "logits_to_keep": 1,
        }
        capture = prefill and self._capture_prefill_queries
        with query_capture(self.assistant_model) if capture else contextlib.nullcontext():
            if forward is self.assistant_model or self._compile_checked:
                logits = forward(**inputs).logits[:, -1, :]
            else:
                logits = self._first_compiled_step(inputs)
        if prefill:
            _synchronize(feed.device)
            self.draft_prefill_seconds += time.perf_counter() - start
        # a compiled step's output lives in its CUDA graph's pool, overwritten by the next replay: always a copy
        return logits.to(torch.float32, copy=forward is self._draft_step and self._compiled)

    def _lean_forward(self, feed: torch.LongTensor, past: int) -> torch.Tensor:
        """`_forward` through the lean step. Its first block in a call also runs the drafter's own forward (after
        rolling the lean step's write back) and keeps drafting lean only if both gave the same logits."""
        positions = torch.arange(past, past + feed.shape[1], device=feed.device)[None]
        logits = self._lean(feed, positions, self.draft_cache)
        if self._lean_checked:
            return logits.float()
        self._lean_checked = True
        self.draft_cache.crop(-feed.shape[1])
        reference = self.assistant_model(
            input_ids=feed,
            position_ids=positions,
            **cache_kwargs(self.draft_cache),
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1, :]
        if not same_logits(logits, reference):
            logger.warning_once(
                f"the lean draft step and {type(self.assistant_model).__name__}'s own forward disagree (largest "
                f"logit difference {float((logits - reference).abs().max()):.3g}); drafting with the drafter's "
                "forward. Pass cache_config={'lean_step': False} to skip the check"
            )
            self._lean = None
        return reference.float()

    def _windowed_prefill(self, prompt: torch.LongTensor, window: int) -> torch.Tensor:
        """Prefill the drafter in windowed chunks (`cache/windowed_prefill.py`), then fill the draft cache with the
        recorded prompt keys/values through its own layers' `update`; the last position's logits `(1, V)`."""
        recorder, logits = windowed_prefill(
            self.assistant_model, prompt, self.plan.spec.num_sink_tokens, window
        )
        fill_from_prefix(self.draft_cache, *recorder.prompt_states())
        return logits

    def _first_compiled_step(self, inputs: dict) -> torch.Tensor:
        """The first call of the compiled step compiles it; if compiling fails (no C++ compiler, an unsupported
        op), warn once and keep drafting eagerly — unless the failed call already wrote to the cache."""
        lengths = self._static_lengths()
        try:
            with _first_compiled_call:  # one thread compiles; the others then reuse its graph
                logits = self._draft_step(**inputs).logits[:, -1, :]
        except Exception as error:  # any compiler failure; the eager step is the same computation
            if self._static_lengths() != lengths:
                raise
            logger.warning_once(
                f"compiling the draft step failed ({type(error).__name__}: {error}); drafting eagerly instead. "
                "Pass cache_config={'compile': False} to skip the attempt."
            )
            logger.debug("the draft step's compilation failed", exc_info=True)
            self._draft_step, self._compiled = self.assistant_model, False
            logits = self.assistant_model(**inputs).logits[:, -1, :]
        self._compile_checked = True
        return logits

    def _static_lengths(self) -> list[int]:
        return [
            int(layer.length)
            for layer in self.draft_cache.layers
            if torch.is_tensor(getattr(layer, "length", None))
        ]

    @torch.no_grad()  # like generate(): inference tensors would break a static cache's in-place bookkeeping
    def _draft(self, generation_args: dict) -> tuple[torch.LongTensor, torch.Tensor]:
        """Draft up to `max_new_tokens` tokens with a plain forward loop (no nested `assistant_model.generate()`).

        Greedy: the argmax of the processed logits. Sampling: a token drawn from the processed distribution (the
        call's temperature / top-k / top-p processors), whose logits are returned for the acceptance test
        (Leviathan et al., arXiv 2211.17192, Algorithm 1). EOS is suppressed for the first `min_new_tokens`; a
        round stops after EOS or below the plan's confidence threshold. Blocks of up to `slack` tokens without
        padding run the lean step when the plan says so, one-token steps the compiled step when it says so.

        Returns `(candidate_ids (1, L + n), candidate_logits (1, n, V))`, `1 <= n <= max_new_tokens`.
        """
        ids = generation_args[self.input_ids_key]  # (1, L)
        min_new, max_new = generation_args["min_new_tokens"], generation_args["max_new_tokens"]
        processors = generation_args["logits_processor"]
        sample = bool(self.generation_config.do_sample)
        eos = self.generation_config.eos_token_id
        eos = torch.tensor([eos] if isinstance(eos, int) else (eos or []), device=ids.device)
        threshold = self.plan.confidence_threshold
        mask = self.assistant_kwargs.get("attention_mask")
        padded = mask is not None and not bool(mask.all())
        # (1, n_new): what the draft cache has not seen yet; a copy, not a strided view of ids, which a compiled
        # step would see as a new input layout
        seen = self.seen_tokens if self.seen_tokens is not None else int(self.draft_cache.get_seq_length())
        feed = ids[:, seen:].clone(memory_format=torch.contiguous_format)
        scores = []
        for step in range(max_new):
            if mask is not None:
                mask = torch.cat([mask, mask.new_ones(1, ids.shape[1] - mask.shape[1])], dim=-1)
            past = ids.shape[1] - feed.shape[1]
            logits = self._forward(feed, past, mask, padded, prefill=past == 0)  # (1, V)
            if self.seen_tokens is not None:
                self.seen_tokens = ids.shape[1]
            # a plain list, not a LogitsProcessorList: AssistedCandidateGenerator filters the call's list
            for processor in processors:
                logits = processor(ids, logits)
            if step < min_new and eos.numel():
                logits[:, eos] = -float("inf")
            probs = logits.softmax(-1) if sample or threshold else None
            token = torch.multinomial(probs, 1) if sample else logits.argmax(-1, keepdim=True)  # (1, 1)
            scores.append(logits)
            ids, feed = torch.cat([ids, token], dim=-1), token
            if eos.numel() and bool(torch.isin(token, eos).any()):
                break
            if threshold and probs[0, token[0, 0]] < threshold:
                break
        if mask is not None:
            self.assistant_kwargs["attention_mask"] = mask
        return ids, torch.stack(scores, dim=1)
