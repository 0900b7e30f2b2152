"""Assisted generation whose assistant drafts on a sparse KV cache while the target keeps its full cache."""

from __future__ import annotations

import torch
from transformers.generation.candidate_generator import AssistedCandidateGenerator

from ..cache import SparseDraftCache
from ..compat import CACHE_KWARG, prepare_draft_inputs
from . import draft_length, drafter_media
from .compiled_step import record_eager_steps
from .draft_length import RoundClock
from .draft_steps import DraftSteps
from .plan import DraftPlan


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
        # the draft's own generate() (nested, for batches) is handed the draft cache itself, never a cache name
        # (transformers resets it from 5.24 on)
        self.generation_config.cache_implementation = None
        self.draft_cache = draft_cache
        self.assistant_kwargs[CACHE_KWARG] = draft_cache
        self.plan = plan
        self.draft_length = draft_length.for_plan(plan)
        self.clock = RoundClock(self.draft_length, assistant_model.device)
        self.steps = DraftSteps.for_plan(
            plan, assistant_model, draft_cache, self._drafter_media(model_kwargs)
        )
        self._drafting = plan.drafting(assistant_model)
        # tokens the draft cache holds, kept on the host: a static cache's own count is a device tensor, and
        # reading it would cost a device synchronisation twice a round (None: unknown, read the cache)
        self.seen_tokens: int | None = 0
        self._padded: bool | None = None  # whether the call's attention mask pads the row (read once)

    def _drafter_media(self, model_kwargs: dict) -> dict:
        """The prompt's images and videos for a multimodal drafter's prefill (`drafter_media.py`)."""
        return drafter_media.for_drafter(self.assistant_model, model_kwargs)

    @property
    def draft_prefill_seconds(self) -> float:
        """Seconds the drafter's prefills took in this call (read by `record_speculation`)."""
        return self.steps.prefill.seconds

    def runtime(self) -> dict:
        """What ran in this call (`SpeculationStats.runtime`): transformers' loop, the target verifying eagerly, the
        draft step, and the inputs a multimodal drafter's prefill read besides the ids."""
        media = sorted(self.steps.prefill.media)
        return {
            "loop": "transformers",
            "verify": None,
            "draft_step": self.steps.record(),
            "drafter_media": media,
        }

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
        if self.clock.drafted_tokens and self.plan.spec.static and not self.steps.compiled:
            record_eager_steps(self.assistant_model, self.clock.draft_seconds)

    def _update_past_and_masks(self, input_ids: torch.LongTensor, *args, **kwargs) -> bool:
        """Roll back exactly the rejected draft tokens, so the cache holds tokens `[0, L - 1)` of `input_ids (1, L)`
        and only the newest token is fed. transformers' own step (whose arguments change between releases) can also
        re-feed the last accepted token, which would roll back into a budgeted cache's compressed prefix right after
        the prefill."""
        cache = self.assistant_kwargs.get(CACHE_KWARG)
        if cache is None:
            return False
        seen = self._cached_tokens()
        self.draft_cache.note_length(seen)  # a static cache then crops without reading its device-side count
        excess = seen - (input_ids.shape[-1] - 1)
        if excess >= 0:
            cache.crop(-excess)
            if self.seen_tokens is not None:
                self.seen_tokens = seen - excess
        self.assistant_kwargs = prepare_draft_inputs(
            self.assistant_kwargs, input_ids.shape[-1], self.assistant_model.config.is_encoder_decoder
        )
        return True

    def _cached_tokens(self) -> int:
        """Tokens the draft cache holds: the host count, or (when unknown) the cache's own, a device read."""
        return self.seen_tokens if self.seen_tokens is not None else int(self.draft_cache.get_seq_length())

    def _generate_candidates(self, generation_args: dict):
        if generation_args[self.input_ids_key].shape[0] != 1:  # batches keep the nested assistant generate()
            self.seen_tokens = None
            return super()._generate_candidates(generation_args)
        return self._draft(generation_args)

    # -- the draft loop ------------------------------------------------------------------------------------------
    @torch.no_grad()  # like generate(): inference tensors would break a static cache's in-place bookkeeping
    def _draft(self, generation_args: dict) -> tuple[torch.LongTensor, torch.Tensor]:
        """Draft up to `max_new_tokens` tokens with a plain forward loop (no nested `assistant_model.generate()`).

        Greedy: the argmax of the processed logits. Sampling: a token drawn from the processed distribution (the
        call's temperature / top-k / top-p processors), whose logits are returned for the acceptance test
        (Leviathan et al., arXiv 2211.17192, Algorithm 1). EOS is suppressed for the first `min_new_tokens`; a
        round stops early only below the plan's confidence threshold. A draft may run past an EOS: transformers'
        loop cuts the accepted tokens at the first EOS, so stopping there would only save the last round a few
        steps, for a device read every step of every round. Each forward runs the call's step for its kind
        (`DraftSteps`: the prefill, a block, a one-token step, a padded row).

        Returns `(candidate_ids (1, L + n), candidate_logits (1, n, V))`, `1 <= n <= max_new_tokens`.
        """
        ids = generation_args[self.input_ids_key]  # (1, L)
        min_new, max_new = generation_args["min_new_tokens"], generation_args["max_new_tokens"]
        processors = generation_args["logits_processor"]
        sample = bool(self.generation_config.do_sample)
        eos = self.generation_config.eos_token_id
        # an int or a list of them, as a config holds them (a tensor converted: the one host read, if given one)
        eos = eos.tolist() if torch.is_tensor(eos) else eos
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        threshold = self.plan.confidence_threshold
        mask = self.assistant_kwargs.get("attention_mask")
        if self._padded is None:
            # the mask only grows by ones: whether it pads is known after the first round
            self._padded = mask is not None and not bool(mask.all())
        # (1, n_new): what the draft cache has not seen yet; a copy, not a strided view of ids, which a compiled
        # step would see as a new input layout
        feed = ids[:, self._cached_tokens() :].clone(memory_format=torch.contiguous_format)
        scores = []
        for step in range(max_new):
            if mask is not None:
                mask = torch.cat([mask, mask.new_ones(1, ids.shape[1] - mask.shape[1])], dim=-1)
            logits = self.steps(feed, ids.shape[1] - feed.shape[1], mask if self._padded else None)  # (1, V)
            if self.seen_tokens is not None:
                self.seen_tokens = ids.shape[1]
            # a plain list, not a LogitsProcessorList: AssistedCandidateGenerator filters the call's list
            for processor in processors:
                logits = processor(ids, logits)
            if step < min_new and eos:  # ids past the drafter's vocabulary (a config's stray EOS) never come
                logits[:, [token for token in eos if token < logits.shape[-1]]] = -float("inf")
            probs = logits.softmax(-1) if sample or threshold else None
            token = torch.multinomial(probs, 1) if sample else logits.argmax(-1, keepdim=True)  # (1, 1)
            scores.append(logits)
            ids, feed = torch.cat([ids, token], dim=-1), token
            if threshold and float(probs.gather(-1, token)) < threshold:  # a device read a step
                break
        if mask is not None:
            self.assistant_kwargs["attention_mask"] = mask
        return ids, torch.stack(scores, dim=1)
