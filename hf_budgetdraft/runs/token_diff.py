"""Greedy-diff losslessness: which generated tokens differ from the target's own greedy output, and the noise
envelope that tells numerical noise from a real change.

Speculative decoding with greedy verification is lossless by construction: the target decides every kept token,
so the output must equal `target.generate(ids, do_sample=False)`. In exact arithmetic every diff is 0. In floating
point the target's logits depend slightly on how many tokens a forward processes (verifying γ+1 tokens vs one),
so on a GPU in bf16 a *native* (stock, full-cache) assisted run can already diverge from plain AR at an argmax
near-tie. The envelope reports that native-vs-AR divergence beside the windowed-vs-native divergence: a sparse
draft is only suspicious when it diverges where native does not — and since the draft side never touches the
target's cache or logits, any divergence beyond the envelope is a bug. On CPU fp32 every cell must be 0.

For a nonzero diff, `divergence_margin` gives the target's own logit gap between the two tokens at the first
divergence: a gap within ~10x the run-to-run logit noise (`bench`'s noise envelope measures it) is a
near-tie, a large gap a real change.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenDiff:
    """How a generated sequence differs from a reference.

    Attributes:
        diff_tokens (`int`): positions whose tokens differ, a length mismatch counting each missing position.
        first_diff (`int | None`): index (into the generated tokens) of the first divergence, `None` if identical.
        compared (`int`): `max(len(output), len(reference))`.
    """

    diff_tokens: int
    first_diff: int | None
    compared: int


def token_diff(output: torch.Tensor, reference: torch.Tensor) -> TokenDiff:
    """Compare generated tokens `output` `(n,)` with `reference` `(m,)` (both without the prompt)."""
    output, reference = output.reshape(-1).cpu(), reference.reshape(-1).cpu()
    common = min(len(output), len(reference))
    mismatch = output[:common] != reference[:common]  # (common,)
    diff = int(mismatch.sum()) + abs(len(output) - len(reference))
    if mismatch.any():
        first = int(mismatch.nonzero()[0, 0])
    elif len(output) != len(reference):
        first = common
    else:
        first = None
    return TokenDiff(diff, first, max(len(output), len(reference)))


@torch.inference_mode()
def divergence_margin(
    model, prompt_ids: torch.LongTensor, reference: torch.Tensor, output: torch.Tensor, index: int
) -> float:
    """The target's logit gap `logit[reference[index]] − logit[output[index]]` after `prompt + reference[:index]`.

    Both sequences share that prefix, so this is the margin by which the target's own full forward prefers the
    greedy token over the other run's token: near 0 means an argmax near-tie (numerical noise can flip it).

    Args:
        model: the target.
        prompt_ids (`torch.LongTensor` of shape `(1, L)`): the prompt.
        reference, output (`torch.Tensor` of shape `(n,)`): the generated tokens of the two runs.
        index (`int`): the first divergence.
    """
    if not 0 <= index < min(len(reference), len(output)):
        raise ValueError(
            f"index={index} must be a position both sequences have (< {min(len(reference), len(output))})"
        )
    device = prompt_ids.device
    prefix = torch.cat([prompt_ids[0], reference[:index].to(device)])[None]  # (1, L + index)
    logits = model(input_ids=prefix, logits_to_keep=1).logits[0, -1].float()  # (V,)
    return float(logits[int(reference[index])] - logits[int(output[index])])


def noise_envelope(outputs: dict[str, list[torch.Tensor]], pairs: list[tuple[str, str, str]]) -> list[dict]:
    """Divergence between runs of one cell (same prompt, same target).

    Args:
        outputs (`dict[str, list[torch.Tensor]]`): per run label, the generated tokens of each repeat.
        pairs (`list[tuple[str, str, str]]`): `(kind, label, baseline_label)` comparisons, e.g.
            `("native_vs_ar", "native γ=4", "ar")`, `("windowed_vs_native", "sink_window B=96 γ=4", "native γ=4")`.

    Returns:
        One dict per pair: `kind, label, baseline, diff_tokens, first_diff` (first repeats compared), plus
        `run_to_run` — the largest diff between repeats of `label` itself (nondeterminism of one method).
    """
    rows = []
    for kind, label, baseline in pairs:
        if label not in outputs or baseline not in outputs:
            continue
        diff = token_diff(outputs[label][0], outputs[baseline][0])
        runs = outputs[label]
        run_to_run = max((token_diff(run, runs[0]).diff_tokens for run in runs[1:]), default=0)
        rows.append(
            {
                "kind": kind,
                "label": label,
                "baseline": baseline,
                "diff_tokens": diff.diff_tokens,
                "first_diff": diff.first_diff,
                "run_to_run": run_to_run,
            }
        )
    return rows


# a top-2 logit gap rounding can flip: this many units in the last place at a logit this large
TIE_ULPS, TIE_LOGIT = 8, 20.0


def tie_tolerance(dtype: torch.dtype) -> float:
    """The largest top-2 logit gap that rounding in `dtype` can flip between two kernels of the same forward:
    `TIE_ULPS` units in the last place at a logit of `TIE_LOGIT`."""
    return TIE_ULPS * torch.finfo(dtype).eps * TIE_LOGIT
