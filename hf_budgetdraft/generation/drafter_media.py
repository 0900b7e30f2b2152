"""A multimodal drafter reads the prompt's images and videos itself, encoded by its own towers.

`generate()` encodes a multimodal target's images before decoding (`_maybe_prepare_encoder_kwargs_for_generation`:
the target's `get_image_features` into `mm_encoder_outputs`) and drops the raw inputs it encoded (`pixel_values`,
`image_grid_thw`, ...). Those encodings are the target's, in its hidden size: transformers' assisted loop hands them
to the assistant as they are, and a drafter of another size gets them scattered into its embeddings in the wrong
shape. The package's draft loop fed its drafter the ids alone, image placeholders included, so a vision-language
drafter (Qwen2.5-VL 3B drafting for 72B, Gemma 3 4B for 27B) drafted blind to the image.

In a sparse-draft call the raw inputs the target's encoder takes are kept here for the call (`keep`), and the
drafter's prefill is given those its forward accepts, with the prompt's token types (`for_drafter`): the drafter
encodes the images with its own towers in one forward, and computes its own positions (Qwen-VL's 3-D rotary
positions; the later draft steps add the offset it recorded, `rope_offset`). Only acceptance depends on it: the
target verifies every token either way.
"""

from __future__ import annotations

import inspect
from contextvars import ContextVar

import torch

from ..compat import CACHE_KWARG
from .model_inputs import TOKEN_TYPES  # which prompt tokens are image or video tokens
from .prefilled import continues_a_prefix

_KEPT: ContextVar[dict | None] = ContextVar("budgetdraft_drafter_media", default=None)


def keep(before: dict, after: dict) -> None:
    """Keep, for this call, the inputs `generate()`'s multimodal encoding took out of the model kwargs (`before` and
    `after` it); replaces what an earlier call kept."""
    _KEPT.set({name: value for name, value in before.items() if name not in after} or None)


def forget() -> None:
    """Drop what `keep` held (the call is done with it)."""
    _KEPT.set(None)


def for_drafter(drafter, model_kwargs: dict) -> dict:
    """The inputs a multimodal `drafter`'s prefill takes besides the ids: the kept images/videos and their sizes, and
    the prompt's token types from `model_kwargs`, those its forward accepts; `{}` for a drafter that reads no image
    (a text model), a call without one, or a call continuing a target cache its caller prefilled (its images are the
    new tokens' alone, where the drafter reads the whole prompt: it reads the ids, as a text drafter does)."""
    kept = _KEPT.get()
    if not kept or continues_a_prefix(model_kwargs.get(CACHE_KWARG)):
        return {}
    accepted = set(inspect.signature(drafter.forward).parameters)
    media = {name: value for name, value in kept.items() if name in accepted}
    if not media:
        return {}
    types = {name: model_kwargs[name] for name in TOKEN_TYPES if name in accepted and name in model_kwargs}
    return {**media, **{name: value for name, value in types.items() if value is not None}}


def fitted(media: dict, length: int) -> dict:
    """`media` for a prefill of `length` tokens: the prompt's token types `(1, L)` marked text (0) on the tokens
    past the prompt (the device round's drafter reads the target's first token with the prompt)."""
    fitted = dict(media)
    for name in TOKEN_TYPES:
        types = media.get(name)
        if isinstance(types, torch.Tensor) and types.shape[-1] < length:
            fitted[name] = torch.nn.functional.pad(types, (0, length - types.shape[-1]))
    return fitted


def rope_offset(drafter) -> int:
    """How far past its count the drafter's text positions run after a multimodal prefill: the `rope_deltas` a
    Qwen-VL-style model records when it computes 3-D rotary positions (an image of n tokens takes fewer than n
    positions), 0 for every other model. One host read, once a call."""
    deltas = getattr(getattr(drafter, "model", None), "rope_deltas", None)
    if not isinstance(deltas, torch.Tensor) or deltas.numel() != 1:
        return 0
    return int(deltas.item())
