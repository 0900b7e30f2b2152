"""The logits processors a loop of the package's own applies to a block of positions at once.

transformers applies its processors one position at a time to the ids before it; the processors below read only
the scores (`SCORE_ONLY`), or only the length (`min_new_tokens` / `min_length`, `suppress_eos`), so a whole
`(B, n, V)` block goes through them in one call. Anything else needs the ids of each position. A processor that
keeps state of its own across steps (`STATEFUL`) cannot follow a speculative round at all (`refuse_stateful`).
"""

from __future__ import annotations

import torch
from transformers.generation.logits_process import (
    ClassifierFreeGuidanceLogitsProcessor,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    InfNanRemoveLogitsProcessor,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
    UnbatchedClassifierFreeGuidanceLogitsProcessor,
)

SCORE_ONLY = (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    MinPLogitsWarper,
    TypicalLogitsWarper,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    InfNanRemoveLogitsProcessor,
    SuppressTokensLogitsProcessor,
)
LENGTH_ONLY = (MinNewTokensLengthLogitsProcessor, MinLengthLogitsProcessor)
# classifier-free guidance runs the model on the unconditional prompt with a cache of its own, one token a step,
# never rolled back: after a rejected draft it guides with the wrong context
STATEFUL = (UnbatchedClassifierFreeGuidanceLogitsProcessor, ClassifierFreeGuidanceLogitsProcessor)


def is_blockwise(processor) -> bool:
    """Whether `processor` can run on a block of positions without the ids before each."""
    return isinstance(processor, SCORE_ONLY + LENGTH_ONLY)


def refuse_stateful(processors, what: str) -> None:
    """Raise if one of `processors` keeps state across steps that a speculative round cannot roll back."""
    stateful = [type(p).__name__ for p in processors or [] if isinstance(p, STATEFUL)]
    if stateful:
        raise ValueError(
            f"{what} cannot run {stateful}: classifier-free guidance (guidance_scale=) keeps an unconditional cache "
            "of its own, one token a step, which a rejected draft would leave wrong, so the output would differ "
            "from the target's own. Drop guidance_scale=, or generate without assistant_model="
        )


def suppress_eos(logits: torch.Tensor, processor, lengths: torch.Tensor) -> torch.Tensor:
    """`min_new_tokens` / `min_length` for `(B, n, V)` logits whose positions have `lengths (B, n)` ids before them:
    EOS impossible where a row is still too short."""
    if isinstance(processor, MinNewTokensLengthLogitsProcessor):
        short = lengths - processor.prompt_length_to_skip < processor.min_new_tokens
    else:
        short = lengths < processor.min_length
    # (V,): which ids are EOS; an EOS id past the vocabulary (a config's stray one) matches nothing
    vocabulary = torch.arange(logits.shape[-1], device=logits.device)
    eos = torch.isin(vocabulary, processor.eos_token_id.to(logits.device))
    return logits.masked_fill(short.to(logits.device)[..., None] & eos, -float("inf"))


def process_block(processors, logits: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Apply blockwise `processors`, in order, to `(B, n, V)` logits whose positions have `lengths (B, n)` ids
    before them."""
    batch, n, vocab = logits.shape
    for processor in processors:
        if isinstance(processor, LENGTH_ONLY):
            logits = suppress_eos(logits, processor, lengths)
        else:
            flat = processor(
                logits.new_zeros(batch * n, 1, dtype=torch.long), logits.reshape(batch * n, vocab)
            )
            logits = flat.reshape(batch, n, vocab)
    return logits
