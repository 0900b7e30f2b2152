"""A drafter with another tokenizer (transformers' universal assisted generation) drafting on a sparse KV cache.

transformers' `AssistedCandidateGeneratorDifferentTokenizers` translates through text every round: the target's
tokens since the last round (and `target_lookbehind` before them, so that a token the new text merges into is
replaced) are decoded and re-read by the drafter's tokenizer. `OtherTokenizerDraftGenerator` keeps that
translation, transformers' own method, and drafts through the call's draft steps on the sparse draft cache, which
it rolls back to the longest prefix it shares with the re-read sequence. Greedy drafts go back to the target as
text tokenized after the target's own last tokens; sampled drafts token for token over the tokens both vocabularies
hold, with their logits. The target verifies the candidates as in any call, so greedy output is the target's own
and sampling keeps its distribution (Timor et al., "Accelerating LLM Inference with Lossless Speculative Decoding
Algorithms for Heterogeneous Vocabularies", arXiv 2502.05202).
"""

from __future__ import annotations

import functools

import torch
from transformers.generation.candidate_generator import (
    AssistantToTargetTranslator,
    AssistedCandidateGeneratorDifferentTokenizers,
)
from transformers.generation.logits_process import SuppressTokensLogitsProcessor
from transformers.utils import logging

from .candidate_generator import SparseDraftCandidateGenerator
from .processors import SCORE_ONLY

# the call's processors that read only scores, never a vocabulary's ids: they apply to the drafter's logits too
VOCABULARY_FREE = tuple(kind for kind in SCORE_ONLY if kind is not SuppressTokensLogitsProcessor)

logger = logging.get_logger(__name__)

_TRANSLATION = (
    "_get_longest_diag_dict",
    "_get_longest_diag_index",
    "_get_tokens_diag",
    "convert_source_tokens_to_target_tokens",
    "_prepare_assistant_input_ids",
    "_process_assistant_outputs",
)


class OtherTokenizerDraftGenerator(SparseDraftCandidateGenerator):
    """`SparseDraftCandidateGenerator` for a drafter whose tokenizer is not the target's.

    Each round: the target's ids `(1, L)` become the drafter's `(1, A)` (`_prepare_assistant_input_ids`); the draft
    cache is cropped back to the first token where what it holds and `(1, A)` differ, and the drafter drafts from
    there; its ids become the target's candidates `(1, L + n)`. Greedy: through their text (`_continuation`, else
    `_process_assistant_outputs`; n >= 0: 0 leaves the round to a plain AR step of the target). Sampling: token for
    token over the tokens both vocabularies hold (the drafter's others suppressed), with the logits they were drawn
    from mapped to the target's vocabulary (transformers' `AssistantToTargetTranslator`, the drafter's LM head left
    as it is), so speculative sampling keeps the target's distribution (arXiv 2502.05202's token-level
    intersection). The prompt's last `hold_back` tokens enter the draft cache after its prefill, within what a crop
    can undo (a crop cannot reach into the selected prompt); a rollback past that re-prefills the draft cache. The
    drafter runs only those of the call's logits processors that read no ids (the others index the target's
    vocabulary); ids past the drafter's tokenizer (a padded vocabulary) are never drafted.
    """

    hold_back = 16

    def __init__(self, *args, target_tokenizer, assistant_tokenizer, target_vocab_size: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.target_tokenizer, self.assistant_tokenizer = target_tokenizer, assistant_tokenizer
        self.target_lookbehind = self.assistant_generation_config.target_lookbehind
        self.assistant_lookbehind = self.assistant_generation_config.assistant_lookbehind
        self.prev_target_ids_len: int | None = None
        self.prev_assistant_ids: torch.LongTensor | None = None
        self.cached_ids: torch.LongTensor | None = None  # (1, n): the drafter's tokens its cache holds
        self.restarts = 0  # re-prefills of the draft cache after a rollback it could not undo
        self.sample = bool(self.generation_config.do_sample)
        self.translator = (
            AssistantToTargetTranslator(
                target_tokenizer, assistant_tokenizer, target_vocab_size, assistant_model=self.assistant_model
            )
            if self.sample
            else None
        )
        self._draft_processors = self._processors_for_the_drafter()
        # the call's mask and positions count the target's tokens, not the drafter's
        mask = self.assistant_kwargs.pop("attention_mask", None)
        self.assistant_kwargs.pop("position_ids", None)
        if mask is not None and not bool(mask.all()):
            raise ValueError(
                "a drafter with another tokenizer (assistant_tokenizer=) reads the prompt's text, and this prompt "
                "is padded (its attention_mask holds zeros): pass the row without padding"
            )

    def _drafter_media(self, model_kwargs: dict) -> dict:
        """Nothing: the drafter's tokens are not the prompt's, so the images' placeholders would not line up."""
        return {}

    def get_candidates(
        self, input_ids: torch.LongTensor, **kwargs
    ) -> tuple[torch.LongTensor, torch.Tensor | None]:
        """This round's candidates `(1, L + n)` in the target's tokens, n >= 0, and, sampling, their logits
        `(1, n, V)`."""
        self.clock.start()
        self.num_assistant_tokens = self.draft_length.next_length()
        candidates, logits = input_ids, None
        if self.num_assistant_tokens > 0:
            with self._drafting():
                candidates, logits = self._translated_draft(input_ids.to(self.assistant_model.device))
        proposed = candidates.shape[-1] - input_ids.shape[-1]
        # a draft whose text gave the target no new token is, for the draft-length policy, one rejected token: it
        # cost a draft, and counted as a plain AR step it would keep the policy drafting for nothing
        self.clock.drafted(max(proposed, 1) if self.num_assistant_tokens > 0 else 0)
        return candidates, logits

    def _processors_for_the_drafter(self) -> list:
        """What shapes the drafter's logits `(1, V')`: its ids without text suppressed (and, sampling, its ids
        without a counterpart in the target's vocabulary), then the call's processors that read no token ids
        (temperature, top-k, top-p, ...: the draft distribution then resembles the target's)."""
        processors = [SuppressPastVocabulary(len(self.assistant_tokenizer))]
        if self.sample and self.translator.logits_processors is not None:
            processors.extend(self.translator.logits_processors)
        return processors + [p for p in self.logits_processor if isinstance(p, VOCABULARY_FREE)]

    def _translated_draft(self, input_ids: torch.LongTensor) -> tuple[torch.LongTensor, torch.Tensor | None]:
        """The candidates `(1, L + n)` and, sampling, their logits `(1, n, V)` in the target's vocabulary."""
        assistant_ids, _ = self._prepare_assistant_input_ids(input_ids)  # (1, A)
        self.prev_assistant_ids = assistant_ids
        self._roll_back_to_shared_prefix(assistant_ids)
        args = {
            self.input_ids_key: assistant_ids,
            "min_new_tokens": 0,
            "max_new_tokens": int(self.num_assistant_tokens),
            "logits_processor": self._draft_processors,
        }
        drafted, scores = self._draft(args)  # (1, A + n), (1, n, V'); the cache holds all but the last token
        # a copy: transformers' translation writes into `prev_assistant_ids` in place
        self.cached_ids = drafted[:, : self.seen_tokens].clone()
        self.prev_target_ids_len, self.prev_assistant_ids = input_ids.shape[1], drafted
        if self.sample:  # token for token, with the distribution they were drawn from
            candidates = self.translator.get_target_ids(assistant_ids, input_ids, drafted)
            return candidates, self.translator.get_target_logits(scores)
        candidates = self._continuation(input_ids, drafted, assistant_ids.shape[1])
        if candidates is None:
            candidates = self._process_assistant_outputs(input_ids, drafted)
        return (candidates if candidates.shape[1] > input_ids.shape[1] else input_ids), None

    def _continuation(self, input_ids, drafted, drafted_from: int) -> torch.LongTensor | None:
        """The drafts `drafted[:, drafted_from:]` as the target's tokens after `input_ids (1, L)`: their text, cut
        from the drafter's tail, tokenized by the target's tokenizer after the text of its own last tokens (an
        anchored translation; transformers' searches for where the two token lists overlap, which repeated text
        can misplace). `None` where the drafts' text does not extend the target's last token's (a merge): then
        transformers' translation decides."""
        look = min(self.assistant_lookbehind, drafted_from)
        text = functools.partial(self.assistant_tokenizer.decode, skip_special_tokens=True)
        before, after = (
            text(drafted[0, drafted_from - look : drafted_from]),
            text(drafted[0, drafted_from - look :]),
        )
        context = self.target_tokenizer.decode(
            input_ids[0, -self.target_lookbehind :], skip_special_tokens=True
        )
        if not after.startswith(before) or len(after) == len(before):
            return None
        tokenize = functools.partial(self.target_tokenizer.encode, add_special_tokens=False)
        alone, extended = tokenize(context), tokenize(context + after[len(before) :])
        if extended[: len(alone)] != alone:
            return None
        new = torch.tensor([extended[len(alone) :]], dtype=input_ids.dtype, device=input_ids.device)
        return torch.cat([input_ids, new], dim=-1)[:, : self.main_model_max_length]

    def _roll_back_to_shared_prefix(self, assistant_ids: torch.LongTensor) -> None:
        """Crop the draft cache to the tokens it shares with `assistant_ids (1, A)` (at most A - 1, so that one is
        fed); the first round prefills all but the last `hold_back` tokens."""
        if self.cached_ids is None:
            prompt = assistant_ids.shape[1] - self.hold_back
            if prompt > 0:
                self.steps(assistant_ids[:, :prompt], 0, None)
                self.cached_ids, self.seen_tokens = assistant_ids[:, :prompt].clone(), prompt
            return
        keep = min(shared_prefix_length(self.cached_ids, assistant_ids), assistant_ids.shape[1] - 1)
        if keep >= self.seen_tokens:
            return
        self.draft_cache.note_length(self.seen_tokens)
        try:
            self.draft_cache.crop(keep - self.seen_tokens)
            self.seen_tokens = keep
        except ValueError as error:  # raised before a layer is cropped; the cache is reset anyway
            self.restarts += 1
            logger.warning_once(
                "the drafter's re-tokenized text differs further back than its draft cache can roll back; the draft "
                "cache is prefilled again (counted in the generator's `restarts`)"
            )
            logger.debug(f"re-prefilling the draft cache: {self.seen_tokens - keep} tokens back, {error}")
            self.draft_cache.reset()
            self.cached_ids, self.seen_tokens = None, 0
            self._roll_back_to_shared_prefix(assistant_ids)


class SuppressPastVocabulary:
    """Logits `(1, V)` of the ids at and past `size` (a drafter's embedding rows its tokenizer never produces: padded
    vocabularies) set to -inf: such an id has no text, so no candidate for the target."""

    def __init__(self, size: int):
        self.size = size

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        if scores.shape[-1] > self.size:
            scores[:, self.size :] = -float("inf")
        return scores


def shared_prefix_length(a: torch.LongTensor, b: torch.LongTensor) -> int:
    """How many leading tokens `a (1, n)` and `b (1, m)` share (one read of the device)."""
    n = min(a.shape[1], b.shape[1])
    differs = (a[0, :n] != b[0, :n]).nonzero()
    return int(differs[0, 0]) if differs.numel() else n


for _name in _TRANSLATION:  # transformers' translation between the two tokenizers, as it is
    setattr(
        OtherTokenizerDraftGenerator,
        _name,
        AssistedCandidateGeneratorDifferentTokenizers.__dict__[_name],
    )
