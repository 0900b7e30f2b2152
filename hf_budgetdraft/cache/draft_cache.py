"""`SparseDraftCache`: a transformers `Cache` whose attention layers are sparse draft layers — a selection
(`selection.py`) on a storage (`draft_layer.py`, `static_draft_layer.py`) — and whose other layers are
transformers' own. `SinkWindowCache` and `BudgetedCache` name its two selections."""

from __future__ import annotations

import functools
from collections.abc import Callable

from transformers import Cache, PreTrainedConfig
from transformers.cache_utils import (
    DYNAMIC_LAYER_TYPE_MAPPING,
    CacheLayerMixin,
    LinearAttentionCacheLayerMixin,
    LinearAttentionLayer,
    get_layer_types_and_kwargs,
)
from transformers.utils import logging

from .draft_layer import DraftLayer
from .policies import KeepPolicy
from .selection import BudgetSelection, Selection, SinkSelection
from .sizes import cache_nbytes, check_size
from .static_draft_layer import StaticDraftLayer, check_static_flag
from .static_sliding_layer import StaticSlidingLayer, fits_a_ring

logger = logging.get_logger(__name__)


# Layer types that keep the layer transformers' `DynamicCache` gives them: bounded already (a sliding or chunked
# window, a convolution state), holding nothing (`dummy`), or attention that selects its own keys (`indexed_attention`,
# DeepSeek-V3.2's sparse attention: its indexer reads the whole cache, so it is kept whole, and this is logged).
NATIVE_LAYER_TYPES = tuple(t for t in DYNAMIC_LAYER_TYPE_MAPPING if t not in ("full_attention", "hybrid"))
_UNBOUNDED_NATIVE = ("indexed_attention",)
# families whose attention adds a bias and a mask built for every past position outside the cache: their scores
# cannot be computed over the subset of keys a sparse layer returns
_SCORES_OVER_EVERY_POSITION = {
    "cpmant": "CPM-Ant adds a segment position bias over every past token to its scores"
}


class SparseDraftCache(Cache):
    """A `Cache` whose attention layers are sparse draft layers; every other layer is transformers' own.

    Args:
        config (`PreTrainedConfig`): the config of the model that will run on this cache.
        selection (`Selection`): which past tokens the draft keeps besides its window (`SinkSelection`,
            `BudgetSelection`, or your own).
        window_length (`int`): most recent past tokens kept, W.
        slack (`int`): extra ring slots; the longest draft round that can be rolled back.
        static (`bool`, defaults to `False`): `StaticDraftLayer`s, whose one-token step has fixed shapes
            (`torch.compile` / CUDA graphs); needs the model to run `attn_implementation="budgetdraft_varlen"`. Same
            keys, same outputs as the dynamic `DraftLayer`s. The model's own sliding layers become
            `StaticSlidingLayer`s (its window as a fixed-shape ring, up to `LARGEST_RING` positions) so that every
            step has fixed shapes.

    A full-attention layer gets a draft layer; a `"hybrid"` layer (attention and a short convolution in one
    decoder layer, e.g. Inkling) gets it plus transformers' convolution state (`with_linear_state`). Every other
    layer type keeps the layer transformers' `DynamicCache` gives it: sliding/chunked windows and convolution states
    (LFM2's `conv` layers) are bounded already; an `indexed_attention` layer (DeepSeek-V3.2) selects its own keys
    from the whole cache and is kept whole (logged). All of them roll back exactly, transformers' layers through
    their past recording (`activate_past_recording`, then `crop(-n)`).

    All-sliding drafters: a model with no full-attention layer (Mistral with `sliding_window` on every layer, the
    sliding MTP layer of Mellum) has nothing to sparsify. It runs on its own cache, exactly as stock assisted
    generation runs it (static: on `StaticSlidingLayer`s), and this is logged once. The requested window is never
    applied to a sliding layer, smaller or larger than the model's own: a sliding layer reads what the model was
    trained to read, at a cost bounded by its own window.

    A layer holding a recurrent state (Mamba, gated delta net) rolls back through the states of its last tokens,
    which transformers records from 5.25 on (`compat.activate_past_recording`); before 5.25 it is refused at the
    first `crop`. Refused always: layer types transformers' `DynamicCache` has no layer for.
    """

    def __init__(
        self,
        config: PreTrainedConfig,
        selection: Selection,
        window_length: int,
        slack: int,
        static: bool = False,
    ):
        if not isinstance(config, PreTrainedConfig):
            raise TypeError(
                f"config must be the model's PreTrainedConfig (e.g. `config=model.config`), got {type(config).__name__}"
            )
        if not isinstance(selection, Selection):
            raise TypeError(
                f"selection must be a Selection (e.g. SinkSelection(64)), got {type(selection).__name__}"
            )
        check_size("window_length", window_length, 1)
        check_size("slack", slack, 1)
        check_static_flag(static, config)
        check_scores_read_a_subset(config)
        self.selection, self.window_length, self.static = selection, window_length, static
        layer_class = StaticDraftLayer if static else DraftLayer

        def make_layer(idx: int) -> DraftLayer:
            return layer_class(selection, window_length, slack, layer_idx=idx)

        def make_sliding_layer(idx: int, sliding_window: int) -> StaticSlidingLayer | None:
            fits = static and fits_a_ring(sliding_window)
            return StaticSlidingLayer(sliding_window, slack, layer_idx=idx) if fits else None

        layer_types, layer_kwargs = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
        layers = [
            _make_cache_layer(idx, layer_type, kwargs, make_layer, make_sliding_layer, config.model_type)
            for idx, (layer_type, kwargs) in enumerate(zip(layer_types, layer_kwargs, strict=True))
        ]
        _log_what_is_not_sparsified(type(self).__name__, config.model_type, layer_types, layers)
        super().__init__(layers=layers)
        self.slack = slack  # the longest draft round a crop can undo

    def note_length(self, length: int) -> None:
        """The caller's exact count of cached tokens, for static layers whose own count is a device tensor that a
        compiled step advances: their host-side bookkeeping (crop, blocks, mask sizes) then reads no device tensor."""
        for layer in self.layers:
            if isinstance(layer, StaticDraftLayer):
                layer.note_length(length)

    def can_skip(self) -> bool:
        """Whether `skip` applies: every layer is a draft layer whose selection allows it (a sink); a model's own
        sliding layers keep theirs."""
        return self.selection.can_skip and all(_sparsified(layer) for layer in self.layers)

    def skip(self, count: int) -> None:
        """Advance every layer over `count` positions nothing will read: a draft head catching up on a long block
        only needs the sink and the last `window_length` positions' keys (a position's keys depend only on its own
        inputs), so it feeds those and skips the rest."""
        if not self.can_skip():
            raise ValueError(
                "skip() needs every cache layer to be a sink + window layer; this model keeps its own sliding layers"
            )
        for layer in self.layers:
            layer.skip(count)

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `-tokens_to_remove` tokens from every layer (exact within the slack, else raises)."""
        for idx, layer in enumerate(self.layers):
            kept = getattr(layer, "recurrent_states_to_keep", None) or 0  # from 5.25: past states recorded
            if (
                any(getattr(layer, "is_recurrent_states_initialized", {}).values())
                and kept < -tokens_to_remove
            ):
                raise ValueError(
                    f"crop({tokens_to_remove}): layer {idx} ({type(layer).__name__}) holds a recurrent state (a "
                    f"stateful model: Mamba, gated delta net, ...) and keeps the states of its last {kept} tokens "
                    "(transformers 5.25 records them, earlier releases none), so a rejected draft cannot be undone "
                    "exactly. Upgrade transformers, or use a drafter made of attention and convolution layers (e.g. "
                    "Llama, LFM2)."
                )
        super().crop(tokens_to_remove)

    def drop_prompt_past(self) -> None:
        """After the drafter's prefill: transformers' own layers (sliding windows, convolution states) recorded the
        whole prompt's past for a rollback that never reaches into the prompt; keep what the next step reads
        (`crop(0)`), so the cache holds its bound from the prefill on, not from the first rollback."""
        if any(
            not isinstance(layer, DraftLayer) or isinstance(layer, LinearAttentionCacheLayerMixin)
            for layer in self.layers
        ):
            self.crop(0)

    @property
    def is_linear(self) -> list[bool]:
        """Whether each layer holds a linear-attention state only (no keys), as transformers >= 5.24 decides it: a
        `"hybrid"` layer (`with_linear_state`) holds keys too. Transformers 5.23 exempts only its own
        `LinearAttentionAndFullAttentionLayer`, so it took ours for a linear layer, found no full-attention layer and
        sized the full-attention mask by layer 0 (Inkling's sliding layer)."""
        return [
            isinstance(layer, LinearAttentionCacheLayerMixin) and not isinstance(layer, CacheLayerMixin)
            for layer in self.layers
        ]

    def nbytes(self) -> int:
        """Bytes held by this cache's buffers (keys and values of every layer, convolution states)."""
        return cache_nbytes(self)


class SinkWindowCache(SparseDraftCache):
    """Draft cache with an attention sink and a sliding window (Windowed-MTP, arXiv 2607.21535: S = 64, W = 4032).

    A query at logical length `L` reads positions `[0, min(S, L))` and `[max(S, L - W), L)`, plus the tokens of its
    own forward, so memory and per-step cost are constant in context length.

    Args:
        config (`PreTrainedConfig`): the config of the model that will run on this cache.
        num_sink_tokens (`int`, defaults to 64): first tokens always kept (attention sink), S.
        window_length (`int`, defaults to 1024): most recent past tokens kept, W.
        slack (`int`, defaults to 32): extra ring slots; the longest draft round that can be rolled back.
        static (`bool`, defaults to `False`): fixed-shape steps (see `SparseDraftCache`).

    Example:
        >>> cache = SinkWindowCache(config=drafter.config, num_sink_tokens=4, window_length=48)
        >>> drafter(input_ids, cache=cache)
    """

    def __init__(
        self,
        config: PreTrainedConfig,
        num_sink_tokens: int = 64,
        window_length: int = 1024,
        slack: int = 32,
        static: bool = False,
    ):
        self.num_sink_tokens = num_sink_tokens
        super().__init__(config, SinkSelection(num_sink_tokens), window_length, slack, static)


class BudgetedCache(SparseDraftCache):
    """Draft cache keeping at most `budget` prefix tokens per layer and KV head, chosen by `policy` (BudgetDraft,
    arXiv 2606.00144, §3.1), + the `window_length` tokens after the prefill. The prefill attends to the whole prompt;
    every later query reads `selected prefix + window + own block`.

    Args:
        config (`PreTrainedConfig`): the config of the model that will run on this cache.
        budget (`int`, defaults to 512): prefix tokens kept per layer and KV head, B.
        policy (`str` or `KeepPolicy`, defaults to `"chunk"`): `"chunk"` (BudgetDraft/TriForce), `"streaming"`,
            `"snapkv"`, or a `KeepPolicy` instance.
        window_length (`int`, defaults to 256): tokens after the prefill kept in the recent window.
        slack (`int`, defaults to 32): the longest draft round that can be rolled back.
        policy_kwargs (`dict`, *optional*): hyper-parameters of a named policy (e.g. `{"chunk_size": 16}`).
        static (`bool`, defaults to `False`): fixed-shape steps (see `SparseDraftCache`).

    Example:
        >>> cache = BudgetedCache(config=drafter.config, budget=64, policy="chunk")
        >>> drafter(prompt_ids, cache=cache)
    """

    def __init__(
        self,
        config: PreTrainedConfig,
        budget: int = 512,
        policy: str | KeepPolicy = "chunk",
        window_length: int = 256,
        slack: int = 32,
        policy_kwargs: dict | None = None,
        static: bool = False,
    ):
        selection = BudgetSelection(budget, policy, policy_kwargs)
        self.budget, self.policy = budget, selection.policy
        super().__init__(config, selection, window_length, slack, static)


def check_scores_read_a_subset(config: PreTrainedConfig) -> None:
    """Refuse a family whose attention scores every past position (a bias built outside the cache)."""
    reason = _SCORES_OVER_EVERY_POSITION.get(config.model_type)
    if reason is not None:
        raise ValueError(
            f"{config.model_type!r} cannot run on a sparse cache: {reason}, so they cannot read a subset of the "
            "keys. Draft with a model of another family, or drop cache_implementation (stock assisted generation)"
        )


def _sparsified(layer) -> bool:
    """Whether `layer` reads the cache's selection: a draft layer, not a model's own sliding window (a ring on the
    static storage, `StaticSlidingLayer`)."""
    return isinstance(layer, DraftLayer) and not layer.is_sliding


def _log_what_is_not_sparsified(
    cache_name: str, model_type: str, layer_types: list[str], layers: list
) -> None:
    if not any(_sparsified(layer) for layer in layers):
        logger.warning_once(
            f"{cache_name}: {model_type!r} has no full-attention layer (layer types {sorted(set(layer_types))}), so "
            "nothing is sparsified: the draft runs on the model's own cache, as stock assisted generation does"
        )
    elif unbounded := sorted(set(layer_types) & set(_UNBOUNDED_NATIVE)):
        logger.warning_once(
            f"{cache_name}: the {unbounded} layers of {model_type!r} select their own keys from the whole cache and "
            "keep it whole (not sparsified); only its full-attention layers are bounded"
        )


# `dummy`: a layer that holds nothing (reusing an earlier layer's keys, Gemma 3n / Gemma 4; an MLP-only layer)
FIXED_SHAPE_LAYER_TYPES = ("full_attention", "sliding_attention", "dummy")


def has_fixed_shape_steps(config: PreTrainedConfig) -> bool:
    """Whether every layer of `config`'s decoder gets a fixed-shape step on a static draft cache: full attention (a
    `StaticDraftLayer`), sliding windows a ring holds (a `StaticSlidingLayer`) and layers holding nothing; no
    convolution or recurrent state, whose transformers layers grow between rollbacks."""
    layer_types, layer_kwargs = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    return all(
        layer_type in FIXED_SHAPE_LAYER_TYPES
        and (layer_type != "sliding_attention" or fits_a_ring(kwargs.get("sliding_window")))
        for layer_type, kwargs in zip(layer_types, layer_kwargs, strict=True)
    )


def _make_cache_layer(
    idx: int,
    layer_type: str,
    kwargs: dict,
    make_layer: Callable,
    make_sliding_layer: Callable,
    model_type: str,
):
    """Layer `idx` of a sparse draft cache: `make_layer(idx)` for full attention, a fixed-shape sliding layer
    (`make_sliding_layer`, static storage only) for a sliding window, transformers' own otherwise."""
    if layer_type == "full_attention":
        return make_layer(idx)
    if layer_type == "hybrid":
        return with_linear_state(make_layer(idx), **kwargs)
    if layer_type == "sliding_attention" and (layer := make_sliding_layer(idx, kwargs["sliding_window"])):
        return layer
    if layer_type in NATIVE_LAYER_TYPES:
        return DYNAMIC_LAYER_TYPE_MAPPING[layer_type](**kwargs)
    raise ValueError(
        f"layer {idx} of {model_type!r} is {layer_type!r}, a layer type transformers' DynamicCache has no cache layer "
        f"for; a sparse draft cache sparsifies 'full_attention' and 'hybrid' layers and keeps transformers' own "
        f"layer for {list(NATIVE_LAYER_TYPES)}. Use a drafter whose layers are of these types."
    )


def with_linear_state(layer: DraftLayer, number_of_states: int = 1):
    """`layer` (a sparse attention layer) that also holds transformers' convolution state, as a `"hybrid"` layer
    type needs (attention and a short convolution in one decoder layer): the attention part is sparsified, the
    convolution state is kept and rolled back by `LinearAttentionLayer`'s own code, as in transformers'
    `LinearAttentionAndFullAttentionLayer`."""
    layer.__class__ = _hybrid_class(type(layer))
    LinearAttentionLayer.__init__(layer, number_of_states=number_of_states)
    return layer


@functools.cache
def _hybrid_class(attention_class: type) -> type:
    def lazy_initialization(self, *args, **kwargs) -> None:
        if args:  # `update(keys, values)` of the attention part
            attention_class.lazy_initialization(self, *args, **kwargs)
        else:  # `update_conv_state` / `update_recurrent_state`, always by keyword
            LinearAttentionLayer.lazy_initialization(self, **kwargs)

    def crop(self, tokens_to_remove: int) -> None:
        attention_class.crop(self, tokens_to_remove)  # checks the slack first
        LinearAttentionLayer.crop(self, tokens_to_remove)

    def reset(self) -> None:
        LinearAttentionLayer.reset(self)
        attention_class.reset(self)

    members = {
        "is_compileable": False,
        "lazy_initialization": lazy_initialization,
        "crop": crop,
        "reset": reset,
        "__repr__": attention_class.__repr__,
        "__module__": __name__,
    }
    # the attention class first: the instance keeps its memory layout (so `__class__` can be reassigned) and its
    # attention-side behaviour; `LinearAttentionLayer` adds the convolution-state methods
    bases = (attention_class, LinearAttentionLayer)
    return type(f"{attention_class.__name__}WithLinearState", bases, members)
