"""Windowed-MTP glue and MTP-head utilities: the model's own MTP head drafts on a sink + window cache.

Windowed-MTP, arXiv 2607.21535. transformers' `generate(use_mtp=True)` drafts with `MtpModel` on an `MtpCache`;
`windowed_mtp_cache` builds the `WindowedMtpCache` (`hf_budgetdraft.cache.windowed`) that replaces it from
`generate()`'s `cache_config`. The other helpers let a model of any depth load, train and save an MTP head.

`cache_config={"static": True}` (with the model loaded with `attn_implementation="budgetdraft_varlen"`) keeps the
ring in slot order: each draft step — and the step that absorbs a round's verified tokens — reads the sink + ring
buffer in place under a slot mask instead of gathering `[sink, window, new]` into a fresh tensor, a copy of the
whole window per step (measured by `benchmarks/mtp_cost.py`, `benchmarks/results/mtp_cost_*.md`).

`AdaptiveMtpCandidateGenerator` lets the draft-length policy of the assistant path drive a one-layer MTP head:
each round it drafts (γ = 1) or lets the target take a plain AR step (γ = 0); the head catches up on the skipped
tokens' hidden states when it drafts again.
"""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel
from transformers.generation.candidate_generator import MTPCandidateGenerator
from transformers.modeling_layers import MtpModel
from transformers.utils import logging

from ..cache.sink_window import SinkWindowCache
from ..cache.windowed import WindowedMtpCache
from ..compat import activate_past_recording
from .draft_length import DraftLength, RoundClock

logger = logging.get_logger(__name__)
MTP_CACHE_OPTIONS = ("num_sink_tokens", "window_length", "slack", "static")
MTP_RUN_OPTIONS = ("draft_length", "fast_verify")


def windowed_mtp_cache(main_model: PreTrainedModel, cache_config: dict | None) -> WindowedMtpCache:
    """The windowed cache for `main_model`'s MTP layers, from `generate()`'s `cache_config` (its run options,
    `draft_length` and `fast_verify`, are read by the caller)."""
    options = {k: v for k, v in (cache_config or {}).items() if k not in MTP_RUN_OPTIONS}
    unknown = sorted(set(options) - set(MTP_CACHE_OPTIONS))
    if unknown:
        raise ValueError(
            f"cache_config keys {unknown} are not options of windowed MTP; accepted: "
            f"{', '.join(MTP_CACHE_OPTIONS + MTP_RUN_OPTIONS)}"
        )
    num_mtp_layers = main_model.config.get_text_config().num_mtp_layers
    # multi-depth MTP rolls its cache back by `num_mtp_layers` tokens when a chain is rejected
    options.setdefault("slack", max(32, num_mtp_layers + 1))
    cache = WindowedMtpCache(config=main_model.config.get_mtp_config(), **options)
    # natively sliding MTP layers (kept as they are) must keep what a rollback needs; depth 1 never rolls back
    if num_mtp_layers > 1:
        activate_past_recording(cache)
    return cache


def mtp_fast_verify(cache_config: dict | None) -> bool:
    """`cache_config["fast_verify"]` (default True): the target of a windowed-MTP call verifies on
    `budgetdraft_sdpa` with a `GrowableCache` and few-row linear layers, as with `assistant_model=`."""
    fast_verify = (cache_config or {}).get("fast_verify", True)
    if not isinstance(fast_verify, bool):
        raise TypeError(f"fast_verify must be a bool, got {fast_verify!r}")
    return fast_verify


def expose_mtp_layers(model: PreTrainedModel) -> PreTrainedModel:
    """Let `MtpModel.from_pretrained(model)` find MTP weights stored right after `model`'s own layers.

    transformers finds MTP weights through the class's `_keys_to_ignore_on_load_unexpected` patterns, which name the
    released checkpoints' layer numbers (e.g. 46 and 92 for GLM-4.5); a model of another depth needs its own.
    """
    config = model.config.get_text_config()
    first, count = config.num_hidden_layers, getattr(config, "num_mtp_layers", None) or 0
    patterns = set(model._keys_to_ignore_on_load_unexpected or ())
    patterns |= {rf"model\.layers\.{first + i}\..*" for i in range(count)}
    model._keys_to_ignore_on_load_unexpected = patterns  # instance attribute: the class stays untouched
    return model


def new_mtp_head(model: PreTrainedModel, num_mtp_layers: int | None = None) -> MtpModel:
    """A freshly initialised `MtpModel` for `model` (to train, or random for tests).

    `MtpModel(model, n)` leaves some parameters (e.g. MoE experts and router) as uninitialised `torch.empty`
    memory — garbage, sometimes NaN; every MTP layer is initialised here with the model's own `_init_weights`.
    """
    if num_mtp_layers is None:
        num_mtp_layers = model.config.get_text_config().num_mtp_layers
    mtp = MtpModel(model, num_mtp_layers)
    with torch.no_grad():
        for layer in mtp.layers:
            layer.apply(model._init_weights)
    return mtp


_PER_LAYER_FIELDS = (("layer_types", "mtp_layer_types"), ("mlp_layer_types", "mtp_mlp_layer_types"))
_EXTRAS = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "post_norm": "shared_head.norm"}


def save_pretrained_with_mtp(model: PreTrainedModel, mtp_model: MtpModel, path: str | Path) -> None:
    """Save `model` with its MTP layers in the checkpoint layout `generate(use_mtp=True)` loads.

    transformers loads MTP weights only from `config.name_or_path` (there is no random-init path), so a freshly
    trained (or random, for tests) MTP head must be written into the checkpoint: MTP layer i is stored as decoder
    layer `num_hidden_layers + i` (written through a deeper copy of the model, so transformers' own reverse weight
    conversions apply, e.g. for fused experts) plus its `enorm`/`hnorm`/`eh_proj`/`shared_head.norm`.
    The round trip is verified.
    """
    path = Path(path)
    config = model.config.get_text_config()
    depth = config.num_hidden_layers
    carrier_config = copy.deepcopy(model.config)
    carrier_text_config = carrier_config.get_text_config()
    carrier_text_config.num_hidden_layers = depth + mtp_model.num_mtp_layers
    for main_field, mtp_field in _PER_LAYER_FIELDS:  # the carrier's extra layers are the MTP layers' types
        if getattr(config, main_field, None) is not None:
            setattr(
                carrier_text_config, main_field, [*getattr(config, main_field), *getattr(config, mtp_field)]
            )
    carrier = type(model)(carrier_config)
    carrier.load_state_dict(model.state_dict(), strict=False)
    for i, layer in enumerate(mtp_model.layers):
        carrier.get_decoder().layers[depth + i].load_state_dict(layer.mtp_block.state_dict())
    carrier.save_pretrained(path, safe_serialization=True)
    model.config.save_pretrained(path)  # the real depth

    weights_file = path / "model.safetensors"
    if not weights_file.exists():
        raise ValueError(
            f"expected one unsharded {weights_file}; save smaller models or extend this to shards"
        )
    state = load_file(weights_file)
    for i, layer in enumerate(mtp_model.layers):
        for name, module in layer.named_children():
            if name in _EXTRAS:
                for param_name, tensor in module.state_dict().items():
                    state[f"model.layers.{depth + i}.{_EXTRAS[name]}.{param_name}"] = tensor.detach().clone()
    save_file(state, weights_file, metadata={"format": "pt"})

    main = expose_mtp_layers(type(model).from_pretrained(path))
    reloaded = MtpModel.from_pretrained(main).state_dict()
    for key, tensor in mtp_model.state_dict().items():
        if key in reloaded and not torch.equal(reloaded[key], tensor):
            raise ValueError(f"MTP weight {key} did not survive the save/load round trip")


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
