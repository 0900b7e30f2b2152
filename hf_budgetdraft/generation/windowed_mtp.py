"""Windowed-MTP glue: the model's own MTP head drafts on a sink + window cache (building a head: `mtp_heads.py`).

Windowed-MTP, arXiv 2607.21535. transformers' `generate(use_mtp=True)` drafts with `MtpModel` on an `MtpCache`;
`windowed_mtp_cache` builds the `WindowedMtpCache` (`hf_budgetdraft.cache.draft_head_caches`) that replaces it from
`generate()`'s `cache_config`.

`cache_config={"static": True}` keeps the ring in slot order (the MTP model's forwards run
`attn_implementation="budgetdraft_varlen"` for the call, the target keeps its own): each draft step — and the step
that absorbs a round's verified tokens — reads the sink + ring buffer in place under a slot mask instead of gathering
`[sink, window, new]` into a fresh tensor, a copy of the whole window per step (measured by `benchmarks/mtp_cost.py`,
`benchmarks/results/mtp_cost_*.md`).

`AdaptiveMtpCandidateGenerator` lets the draft-length policy of the assistant path drive a one-layer MTP head:
each round it drafts (γ = 1) or lets the target take a plain AR step (γ = 0); the head catches up on the skipped
tokens' hidden states when it drafts again.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch
from transformers import PreTrainedConfig, PreTrainedModel
from transformers.generation.candidate_generator import MTPCandidateGenerator
from transformers.utils import logging

from ..attention.scoped import attention_scope
from ..attention.varlen import NAME as VARLEN
from ..cache.draft_cache import SinkWindowCache
from ..cache.draft_head_caches import WindowedMtpCache
from ..compat import activate_past_recording
from .cache_config import WindowedSpec
from .draft_length import DraftLength, RoundClock, for_mtp
from .plan import SDPA_FAMILY, static_cache_problem

logger = logging.get_logger(__name__)


def windowed_mtp_cache(
    main_model: PreTrainedModel, spec: WindowedSpec | dict | None, mtp_config: PreTrainedConfig | None = None
) -> WindowedMtpCache:
    """The windowed cache for `main_model`'s MTP layers, from a call's `cache_config` (parsed, or a dict parsed
    here); `mtp_config`: the config the MTP model was built with (default: `main_model.config.get_mtp_config()`)."""
    if not isinstance(spec, WindowedSpec):
        spec = WindowedSpec.from_cache_config("mtp", spec)
    options = dict(spec.cache_options)
    num_mtp_layers = main_model.config.get_text_config().num_mtp_layers
    # multi-depth MTP rolls its cache back by `num_mtp_layers` tokens when a chain is rejected
    options.setdefault("slack", max(32, num_mtp_layers + 1))
    cache = WindowedMtpCache(config=mtp_config or main_model.config.get_mtp_config(), **options)
    # natively sliding MTP layers (kept as they are) must keep what a rollback needs; depth 1 never rolls back
    if num_mtp_layers > 1:
        activate_past_recording(cache)
    return cache


def windowed_mtp_generator(
    main_model: PreTrainedModel, generator: MTPCandidateGenerator, spec: WindowedSpec
) -> MTPCandidateGenerator:
    """transformers' MTP candidate generator `generator` drafting on the windowed cache `spec` asks for, under the
    draft-length policy it names. With `static`, the MTP model's own forwards run `budgetdraft_varlen` (which reads
    the ring in place) for the call: the target keeps its attention, and no config is written."""
    static = bool(spec.cache_options.get("static"))
    scope = _static_mtp_scope(generator.mtp_model) if static else contextlib.nullcontext
    with scope():
        generator.mtp_cache = windowed_mtp_cache(main_model, spec, generator.mtp_model.config)
    policy = for_mtp(spec.draft_length, generator.num_mtp_layers)
    if policy is not None:
        generator = AdaptiveMtpCandidateGenerator(generator, policy)
    if static:  # every MTP forward of the call runs inside `get_candidates`
        drafting = generator.get_candidates

        def get_candidates(*args, **kwargs):
            with scope():
                return drafting(*args, **kwargs)

        generator.get_candidates = get_candidates  # this call's generator only
    return generator


def _static_mtp_scope(mtp_model: PreTrainedModel):
    """`attention_scope(mtp_model, "budgetdraft_varlen")`, or why an MTP head cannot read a static ring."""
    implementation = mtp_model.config._attn_implementation
    problem = static_cache_problem(mtp_model)
    if implementation not in SDPA_FAMILY or not mtp_model._can_set_attn_implementation():
        problem = f"it runs attn_implementation={implementation!r}, not an sdpa-family attention"
    if problem:
        raise ValueError(
            f"static=True reads the MTP ring through budgetdraft_varlen, but this model's MTP head cannot: {problem}. "
            "Use cache_config={'static': False}"
        )
    return attention_scope(mtp_model, VARLEN)


class AdaptiveMtpCandidateGenerator(MTPCandidateGenerator):
    """transformers' MTP candidate generator for a one-layer head, drafting only in the rounds its `DraftLength`
    policy picks (γ = 1); in the others (γ = 0) the target takes a plain AR step and the head is not run.

    The head's cache must still see every token: the hidden states the target produced for the tokens of skipped
    rounds are kept, `(1, n, H)` each, and fed with the next drafting round's in one block (the head's prefill too,
    when the first rounds are skipped). A one-layer head never rolls its cache back (its input is always a
    verified token), so no skipped round leaves anything to undo. On a sink + window cache a block longer than the
    window is fed in two parts: what the sink still lacks, then its last `window_length` positions; the positions
    between are skipped (`SinkWindowCache.skip`) — a position's keys depend only on its own inputs, and those would
    have left the window unread — so catching up costs O(window), not the O(L²) prefill of the whole prompt.

    Args:
        stock (`MTPCandidateGenerator`): the generator transformers built for the call (its MTP model, cache and
            sampling settings are taken over).
        draft_length (`DraftLength`): the policy; `next_length()` is 0 or 1.
    """

    skip_what_the_window_drops = True

    def __init__(self, stock: MTPCandidateGenerator, draft_length: DraftLength):
        if stock.num_mtp_layers != 1:
            raise ValueError(
                f"an adaptive draft length drives a one-layer MTP head; this model has {stock.num_mtp_layers} MTP "
                "layers, which draft a fixed chain: pass cache_config={'draft_length': <num_mtp_layers>}"
            )
        self.__dict__.update(stock.__dict__)
        self.draft_length = draft_length
        self.clock = RoundClock(draft_length, self.device)
        self._skipped: list[torch.Tensor] = []  # hidden states (1, n, H) of tokens the head has not seen yet
        self._after_prefill = False

    def get_candidates(
        self, input_ids, model_kwargs, model_outputs, is_first_iteration, n_last_matches, **kwargs
    ):
        self.clock.start()
        if is_first_iteration:  # the target's prefill comes first (the stock generator's own trick)
            self.clock.drafted(0)
            return super().get_candidates(
                input_ids, model_kwargs, model_outputs, True, n_last_matches, **kwargs
            )
        hidden = model_outputs.hidden_states[-1]  # (1, processed, H): the target's last forward
        verified = n_last_matches + 1 if self._after_prefill else input_ids.shape[1] - 1
        self._after_prefill = True
        self._skipped.append(hidden[:, :verified])
        candidates, logits = input_ids, None
        if self.draft_length.next_length() > 0:
            unseen = torch.cat(self._skipped, dim=1) if len(self._skipped) > 1 else self._skipped[0]
            self._skipped = []
            if self.skip_what_the_window_drops:
                unseen = self._feed_sink_and_skip(unseen, input_ids, model_kwargs, kwargs)
            # the stock generator feeds the head the last `n_last_matches + 1` tokens with these hidden states (at
            # its own first call, every token so far: the prefill and the skipped rounds)
            outputs = SimpleNamespace(hidden_states=(unseen,))
            candidates, logits = super().get_candidates(
                input_ids, model_kwargs, outputs, False, unseen.shape[1] - 1, **kwargs
            )
        self.clock.drafted(candidates.shape[1] - input_ids.shape[1])
        return candidates, logits

    def _feed_sink_and_skip(self, unseen, input_ids, model_kwargs, kwargs) -> torch.Tensor:
        """Of the unseen hidden states `(1, n, H)` (the head's inputs are the last n tokens), feed the head the ones the
        sink still needs, skip those the window would drop, and return the last `window_length` for the drafting
        forward. Anything else (a native MTP cache, sliding layers, a short block) is returned whole."""
        cache, count = self.mtp_cache, unseen.shape[1]
        if not isinstance(cache, SinkWindowCache) or not cache.can_skip():
            return unseen
        length = int(cache.get_seq_length())
        into_sink = max(max(cache.num_sink_tokens, 1) - length, 0)  # skip() needs the sink and a stored token
        skipped = count - into_sink - cache.window_length
        if skipped <= 0:
            return unseen
        if into_sink:
            first = input_ids.shape[1] - count  # the head's input i is (token first + i, hidden state i)
            self.mtp_model.forward_layer(
                0,
                unseen[:, :into_sink].to(self.device),
                model_kwargs["position_ids"][:, first : first + into_sink],
                cache,
                input_ids=input_ids[:, first : first + into_sink],
                **kwargs,
            )
        cache.skip(skipped)
        self.is_main_model_prefill = False  # the stock generator now feeds exactly the block it is given
        return unseen[:, -cache.window_length :]

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        self.clock.finish(int(num_matches))
