"""Seeded long-context task builders: passkey/needle retrieval at a chosen depth.

Passkey retrieval after Mohtashami & Jaggi, "Landmark Attention", arXiv 2305.16300: a pass key hidden at a given
depth of a long filler (the classic repeated sentences, or real text as the haystack), then asked for at the end.
`needle_position` lets a benchmark place the needle just outside a draft's window (and not in its sink) — the case
that can break windowed drafting (Windowed-MTP's missing falsifier).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there.\n"
)
FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "\nWhat is the pass key? The pass key is"


@dataclass
class PasskeySample:
    input_ids: torch.LongTensor  # (1, context_length): the prompt, ending with the question
    answer_ids: torch.LongTensor  # (1, n): the key's tokens (with its leading space)
    key: str
    needle_position: int  # token index where the needle sentence starts


def passkey_sample(
    tokenizer,
    context_length: int,
    depth: float | None = None,
    needle_position: int | None = None,
    seed: int = 0,
    digits: int = 5,
    haystack_ids: torch.LongTensor | None = None,
) -> PasskeySample:
    """A passkey prompt of exactly `context_length` tokens.

    Args:
        tokenizer: the model's tokenizer (digits should be single tokens).
        context_length (`int`): prompt length in tokens.
        depth (`float`, *optional*): where the needle goes, as a fraction of the haystack (0 = start, 1 = end).
        needle_position (`int`, *optional*): or the exact token index of the needle (overrides `depth`).
        seed (`int`): picks the key (and the depth when neither is given).
        digits (`int`): key length.
        haystack_ids (`torch.LongTensor` of shape `(n,)`, *optional*): real text to use as filler instead of the
            classic repeated sentences; it is cycled if too short.
    """
    rng = random.Random(seed)
    key = "".join(rng.choice("0123456789") for _ in range(digits))
    intro = tokenizer(INTRO, add_special_tokens=False).input_ids
    needle = tokenizer(NEEDLE.format(key=key), add_special_tokens=False).input_ids
    question = tokenizer(QUESTION, add_special_tokens=False).input_ids
    answer = tokenizer(" " + key, add_special_tokens=False).input_ids
    budget = context_length - len(intro) - len(needle) - len(question)
    if budget < 0:
        raise ValueError(
            f"context_length={context_length} is too short for a passkey prompt; use >= {context_length - budget}"
        )
    if haystack_ids is None:
        unit = tokenizer(FILLER, add_special_tokens=False).input_ids
        haystack_ids = torch.tensor(unit * (budget // len(unit) + 1))
    filler = haystack_ids.repeat(budget // max(len(haystack_ids), 1) + 1)[:budget].tolist()
    if needle_position is not None:
        split = needle_position - len(intro)
        if not 0 <= split <= budget:
            raise ValueError(
                f"needle_position={needle_position} must be in [{len(intro)}, {len(intro) + budget}]"
            )
    else:
        split = round((rng.random() if depth is None else depth) * budget)
    ids = intro + filler[:split] + needle + filler[split:] + question
    return PasskeySample(
        input_ids=torch.tensor([ids]),
        answer_ids=torch.tensor([answer]),
        key=key,
        needle_position=len(intro) + split,
    )
