"""Assisted generation whose assistant drafts on a sparse KV cache while the target keeps its full cache."""

from __future__ import annotations

import torch
from transformers import CompileConfig
from transformers.generation.candidate_generator import AssistedCandidateGenerator

from ..attention.query_capture import query_capture
from ..cache import BudgetedCache, SparseDraftCache


def draft_step_compile_config(device: torch.device | str) -> CompileConfig:
    """How to compile a static draft cache's one-token step (set it as `drafter.generation_config.compile_config`).

    One graph of fixed shapes (`dynamic=False`) for the whole generation. CUDA: CUDA graphs (`reduce-overhead`).
    Elsewhere: inductor with its C++ wrapper, which calls the generated kernels from C++ instead of a Python
    wrapper; for a small drafter the step is mostly that overhead (the bundled drafter: 0.86 vs 0.97 ms a step on
    2 CPU threads, same outputs; the first compilation takes ~15 s instead of ~6 s).
    """
    if torch.device(device).type == "cuda":
        return CompileConfig(dynamic=False, mode="reduce-overhead")
    return CompileConfig(dynamic=False, mode=None, options={"cpp_wrapper": True})


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
        self._draft_step = self._one_token_forward()

    def _one_token_forward(self):
        """The drafter's forward for one-token draft steps: `torch.compile`d when the draft cache is static.

        Compiled when the drafter's own `generation_config.compile_config` is set (any device, CPU included: there a
        small drafter's step is mostly Python overhead) or where transformers auto-compiles a static cache's decode
        loop (CUDA/XPU); never with `generate(..., disable_compile=True)`. (`generate()`'s own `compile_config` is the
        target's: transformers clears it for the assistant.) A static cache's one-token step has fixed shapes, so it
        compiles once and is reused at every context length; the prefill and multi-token feeds stay eager.
        """
        model, config = self.assistant_model, self.generation_config
        if not self.draft_cache.static or config.disable_compile:
            return model
        compile_config = model.generation_config.compile_config
        if compile_config is None and not model._valid_auto_compile_criteria(
            {"cache": self.draft_cache}, config
        ):
            return model
        return model.get_compiled_call(compile_config)

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
        # sampling (and batches) keep the nested assistant generate() and its sampler
        if self.generation_config.do_sample or generation_args[self.input_ids_key].shape[0] != 1:
            return super()._generate_candidates(generation_args)
        return self._draft_greedily(generation_args)

    @torch.no_grad()  # like generate(): inference tensors would break a static cache's in-place bookkeeping
    def _draft_greedily(self, generation_args: dict) -> tuple[torch.LongTensor, torch.Tensor]:
        """Greedy drafts with a plain forward loop instead of a nested `assistant_model.generate()` per round.

        Same tokens as the nested call: the uncached tail, then one token per step, scored by the call's logits
        processors, EOS suppressed for the first `min_new_tokens`, stopping after EOS or a draft token whose
        probability is below `assistant_confidence_threshold`. What it saves is the per-round set-up of a
        `generate()` call (config copies, argument validation, stopping criteria), ~1/4 of a small drafter's round.
        One-token steps without padding run `self._draft_step` (compiled on a static cache, see `_one_token_forward`).

        Returns `(candidate_ids (1, L + n), candidate_logits (1, n, V))`, `n <= max_new_tokens`.
        """
        ids = generation_args[self.input_ids_key]  # (1, L)
        min_new, max_new = generation_args["min_new_tokens"], generation_args["max_new_tokens"]
        processors = generation_args["logits_processor"]
        eos = self.generation_config.eos_token_id
        eos = torch.tensor([eos] if isinstance(eos, int) else (eos or []), device=ids.device)
        threshold = self.generation_config.assistant_confidence_threshold
        mask = self.assistant_kwargs.get("attention_mask")
        cache = self.draft_cache
        # (1, n_new): what the draft cache has not seen yet; a copy, not a strided view of ids, which a compiled step
        # would see as a new input layout (a recompile)
        feed = ids[:, cache.get_seq_length() :].clone(memory_format=torch.contiguous_format)
        padded = mask is not None and not bool(mask.all())
        scores = []
        for step in range(max_new):
            past = ids.shape[1] - feed.shape[1]
            if mask is not None:
                mask = torch.cat([mask, mask.new_ones(1, ids.shape[1] - mask.shape[1])], dim=-1)
            forward = self._draft_step if feed.shape[1] == 1 and not padded else self.assistant_model
            logits = (
                forward(
                    input_ids=feed,
                    # an all-ones mask changes nothing, and its growing length would recompile a compiled step
                    attention_mask=mask if padded else None,
                    position_ids=torch.arange(past, ids.shape[1], device=ids.device)[None],
                    cache=cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
                .logits[:, -1, :]
                .float()
            )  # (1, V)
            # a plain list, not a LogitsProcessorList: AssistedCandidateGenerator filters the call's list
            for processor in processors:
                logits = processor(ids, logits)
            if step < min_new and eos.numel():
                logits[:, eos] = -float("inf")
            token = logits.argmax(-1, keepdim=True)  # (1, 1)
            scores.append(logits)
            ids, feed = torch.cat([ids, token], dim=-1), token
            if bool(torch.isin(token, eos).any()):
                break
            if threshold and logits.softmax(-1)[0, token[0, 0]] < threshold:
                break
        if mask is not None:
            self.assistant_kwargs["attention_mask"] = mask
        return ids, torch.stack(scores, dim=1)
