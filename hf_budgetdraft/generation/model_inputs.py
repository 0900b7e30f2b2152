"""The model inputs of a call that the package's own loops do not feed the target.

transformers' loop gives the target every model input of a call through `prepare_inputs_for_generation`: an image
or video (`pixel_values`, or its encoding in `mm_encoder_outputs` from 5.25 on), token types, multimodal rotary
positions (Qwen2-VL's 3-D `position_ids`, shifted past an image). The package's own loops (the batched loop, the
device round) and its chunked prefill feed the target the prompt's ids (or `inputs_embeds`), an attention mask and
positions counted along each row, nothing else. A call with any other input runs transformers' loop, or is refused
where there is none to run; it is never dropped. The device round also takes what transformers' loop feeds the
first forward only (`prompt_only_inputs`: images, the prompt's token types and multimodal positions): its prefill
is that forward, and its later positions run on past the prompt's last.
"""

from __future__ import annotations

import torch
from transformers.generation.utils import MULTIMODAL_INPUTS_TO_DROP_OUTSIDE_PREFILL

# what the loops feed or read themselves, and the call's controls (not model inputs)
_CARRIED = frozenset(
    {
        "generation_config",
        "assistant_model",
        "assistant_tokenizer",
        "tokenizer",
        "logits_processor",
        "stopping_criteria",
        "synced_gpus",
        "streamer",
        "inputs_tensor",
        "attention_mask",
        "inputs_embeds",
        "use_cache",
        "logits_to_keep",
        "cache_position",
        "past_key_values",
        "cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
    }
)
# the inputs that mark which prompt tokens are image or video tokens; all zeros (text only) change nothing a loop
# of ours computes
TOKEN_TYPES = ("token_type_ids", "mm_token_type_ids")


def uncarried_inputs(kwargs: dict, input_ids: torch.LongTensor | None) -> list[str]:
    """Names of the model inputs in a call's `kwargs` that the package's own loops would not feed the target
    (`[]`: none). `input_ids (B, L)`: the prompt. Reads values on the host only for token types and 3-D positions."""
    names = []
    for name, value in kwargs.items():
        if name in _CARRIED or _empty(value):
            continue
        if name in TOKEN_TYPES and isinstance(value, torch.Tensor) and not bool(value.any()):
            continue
        if name == "position_ids" and _counted_along_rows(value, kwargs.get("attention_mask"), input_ids):
            continue
        names.append(name)
    return sorted(names)


def _empty(value) -> bool:
    if value is None:
        return True
    if isinstance(value, dict):
        return all(_empty(item) for item in value.values())
    return isinstance(value, (list, tuple)) and len(value) == 0


def _counted_along_rows(positions, mask: torch.Tensor | None, input_ids: torch.LongTensor | None) -> bool:
    """Whether `positions` are the positions the loops count themselves: 0, 1, ... along each row's unpadded tokens.
    `(B, L)` positions are transformers' own, counted from the mask (read as such: a text call reads nothing on the
    host); `(k, B, L)` ones, a multimodal rotary model's, are compared (a text-only prompt has every slice the
    same)."""
    if not isinstance(positions, torch.Tensor) or input_ids is None or positions.dim() not in (2, 3):
        return False
    rows, length = input_ids.shape
    if positions.shape[-2] != rows or positions.shape[-1] < length:
        return False
    if positions.dim() == 2:
        return True
    if mask is None:
        counted = torch.arange(positions.shape[-1], device=positions.device).expand(rows, -1)
        return bool((positions == counted).all())
    if positions.shape[-1] != mask.shape[-1]:
        return False
    counted = mask.long().cumsum(-1) - 1
    return bool(((positions == counted) | (mask == 0)).all())


def prompt_only_inputs(kwargs: dict, input_ids: torch.LongTensor | None) -> dict:
    """The inputs among `uncarried_inputs` that only the prompt's forward needs (`{name: value}`): what transformers'
    loop feeds the first forward alone (an image, its encoding), and the prompt's own token types `(1, L)` and
    multimodal positions `(k, 1, L)`, which the later, text-only tokens do without (their positions continue from
    the prompt's last, `position_offset`)."""
    if input_ids is None:
        return {}
    length = input_ids.shape[-1]
    kept = {}
    for name in uncarried_inputs(kwargs, input_ids):
        value = kwargs[name]
        prompt_long = isinstance(value, torch.Tensor) and value.shape[-1] == length
        if (
            name in MULTIMODAL_INPUTS_TO_DROP_OUTSIDE_PREFILL
            or (name in TOKEN_TYPES and prompt_long and value.dim() == 2)
            or (name == "position_ids" and prompt_long and value.dim() == 3)
        ):
            kept[name] = value
    return kept


def position_offset(inputs: dict, length: int) -> int:
    """How far the text positions after a prompt of `length` tokens run past their count: Qwen-VL's multimodal
    positions `(3, 1, L)` (temporal, height, width; after a row of counted text positions in transformers 5.25's
    `(4, 1, L)`) give an image of n tokens fewer than n positions; 0 without them. One host read."""
    positions = inputs.get("position_ids")
    if not isinstance(positions, torch.Tensor) or positions.dim() != 3:
        return 0
    return int(positions[-3:, :, -1].max()) + 1 - length
