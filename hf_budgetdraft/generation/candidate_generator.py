"""Assisted generation whose assistant drafts on a sparse KV cache while the target keeps its full cache."""

from __future__ import annotations

import torch
from transformers.generation.candidate_generator import AssistedCandidateGenerator

from ..attention.query_capture import query_capture
from ..cache import BudgetedCache, SparseDraftCache


class SparseDraftCandidateGenerator(AssistedCandidateGenerator):
    """`AssistedCandidateGenerator` with the assistant's cache replaced by a `SparseDraftCache`.

    Only the draft reads the sparse cache; the target verifies every candidate on its own full cache, so greedy
    output equals the target's greedy output and sampling keeps the target's distribution. After each round the
    draft cache is rolled back over the rejected tail with `crop(-n)` (never re-prefilled); the draft length,
    including the "heuristic" schedule, is capped at the cache's rollback slack.
    """

    def __init__(
        self,
        input_ids: torch.LongTensor,
        assistant_model,
        generation_config,
        model_kwargs: dict,
        draft_cache: SparseDraftCache,
        inputs_tensor: torch.Tensor | None = None,
        logits_processor=None,
    ):
        super().__init__(
            input_ids, assistant_model, generation_config, model_kwargs, inputs_tensor, logits_processor
        )
        if self.num_assistant_tokens > draft_cache.max_draft_tokens:
            raise ValueError(
                f"num_assistant_tokens={self.num_assistant_tokens} exceeds the draft cache's rollback slack "
                f"({draft_cache.max_draft_tokens}); pass cache_config={{'slack': {int(self.num_assistant_tokens)}, ...}} "
                "or lower num_assistant_tokens"
            )
        draft_cache.activate_past_recording()  # sliding-window layers (if any) must be able to roll back too
        self.draft_cache = draft_cache
        self.assistant_kwargs["cache"] = draft_cache
        policy = getattr(draft_cache, "policy", None)
        self._capture_prefill_queries = isinstance(draft_cache, BudgetedCache) and policy.needs_queries

    def _update_past_and_masks(
        self, input_ids: torch.LongTensor, remove_from_pkv: int = 0, num_added_tokens: int = 1
    ):
        # Roll back exactly the rejected draft tokens, so the cache holds tokens [0, len - 1) and only the newest
        # token is fed. transformers' default also re-feeds the last accepted token, which would roll back into a
        # budgeted cache's compressed prefix right after the prefill.
        return super()._update_past_and_masks(input_ids, remove_from_pkv, num_added_tokens=0)

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int):
        super().update_candidate_strategy(input_ids, scores, num_matches)
        self.num_assistant_tokens = min(self.num_assistant_tokens, self.draft_cache.max_draft_tokens)

    def _generate_candidates(self, generation_args: dict):
        if self._capture_prefill_queries:  # only the prefill is scored with queries
            self._capture_prefill_queries = False
            with query_capture(self.assistant_model):
                return super()._generate_candidates(generation_args)
        return super()._generate_candidates(generation_args)
