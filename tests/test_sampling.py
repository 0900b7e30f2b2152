"""Speculative sampling with a sparse draft keeps the target's distribution (a chi-square test).

The draft (one layer, reading a sparse cache) has its own distribution, different from the target's; transformers' speculative
sampling must still emit tokens distributed exactly as the target samples them. We compare the empirical
distribution of the first two sampled tokens with the exact target marginals."""

import math

import pytest
import torch
from tiny_models import model_pair, random_prompt

import hf_budgetdraft  # noqa: F401  (registers the sparse cache implementations)

SAMPLES = 1200


def chi_square_quantile(df: int, z: float = 3.09) -> float:
    """Upper 0.1% quantile of chi-square(df), Wilson-Hilferty approximation."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    expected = probs * counts.sum()
    big = expected >= 5  # merge rare outcomes into one bin
    observed = torch.cat([counts[big], counts[~big].sum(0, keepdim=True)])
    expected = torch.cat([expected[big], expected[~big].sum(0, keepdim=True)])
    stat = float(((observed - expected) ** 2 / expected.clamp_min(1e-9)).sum())
    return stat, int(big.sum())


@pytest.mark.parametrize(
    "implementation,cache_config",
    [
        ("sink_window", {"num_sink_tokens": 2, "window_length": 8}),
        ("budgeted", {"budget": 16, "policy": "chunk", "policy_kwargs": {"chunk_size": 4}}),
    ],
)
def test_sampling_keeps_target_distribution(implementation, cache_config):
    target, drafter = model_pair("llama", "sdpa", num_assistant_tokens=3, draft_layers=1)
    ids = random_prompt(64, seed=5)
    with torch.no_grad():
        first = target(ids).logits[0, -1].softmax(-1)  # p(t1)
        continued = torch.cat([ids.expand(first.numel(), -1), torch.arange(first.numel())[:, None]], dim=1)
        second = (first[:, None] * target(continued).logits[:, -1].softmax(-1)).sum(0)  # p(t2)
        draft_first = drafter(ids).logits[0, -1].softmax(-1)
    assert (draft_first - first).abs().sum() > 0.05  # the draft really is a different distribution

    torch.manual_seed(0)
    counts = torch.zeros(2, first.numel())
    for _ in range(SAMPLES):
        out = target.generate(
            ids,
            assistant_model=drafter,
            do_sample=True,
            max_new_tokens=2,
            cache_implementation=implementation,
            cache_config=cache_config,
        )
        counts[0, out[0, -2]] += 1
        counts[1, out[0, -1]] += 1
    for position, probs in enumerate((first, second)):
        stat, df = chi_square(counts[position], probs)
        assert stat < chi_square_quantile(df), f"token {position}: chi2={stat:.1f} with df={df}"
