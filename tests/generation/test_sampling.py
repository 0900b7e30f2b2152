"""Speculative sampling with a sparse draft keeps the target's distribution (a chi-square test).

The draft (one layer, reading a sparse cache) has its own distribution, different from the target's; transformers' speculative
sampling must still emit tokens distributed exactly as the target samples them. We compare the empirical
distribution of the first two sampled tokens with the exact target marginals."""

import math

import pytest
import torch
from tiny_models import model_pair, random_prompt
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from hf_budgetdraft import record_speculation
from hf_budgetdraft.generation.candidate_generator import SparseDraftCandidateGenerator

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


def warped(logits: torch.Tensor, temperature=1.0, top_k=None, top_p=None) -> torch.Tensor:
    """What the call's processors make of raw logits `(N, V)`: temperature, then top-k, then top-p (as
    transformers orders its warpers), as probabilities."""
    processors = [TemperatureLogitsWarper(temperature)]
    if top_k:
        processors.append(TopKLogitsWarper(top_k))
    if top_p:
        processors.append(TopPLogitsWarper(top_p))
    for processor in processors:
        logits = processor(None, logits)
    return logits.softmax(-1)


CASES = {
    "sink_window": ("sink_window", {"num_sink_tokens": 2, "window_length": 8}, {}),
    "budgeted": ("budgeted", {"budget": 16, "policy": "chunk", "policy_kwargs": {"chunk_size": 4}}, {}),
    "budgeted-t0.7-top_k": ("budgeted", {"budget": 16}, {"temperature": 0.7, "top_k": 20}),
    "sink_window-top_p-adaptive": ("sink_window", {"num_sink_tokens": 2, "window_length": 8}, {"top_p": 0.8}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_sampling_keeps_target_distribution(case):
    implementation, cache_config, sampling = CASES[case]
    gamma = None if case.endswith("adaptive") else 3  # None: the package's own draft-length policy
    target, drafter = model_pair("llama", "sdpa", num_assistant_tokens=gamma, draft_layers=1)
    ids = random_prompt(64, seed=5)
    kwargs = {"temperature": 1.0, "top_k": 0, **sampling}
    with torch.no_grad():
        first = warped(target(ids).logits[0, -1:], **kwargs)[0]  # p(t1)
        continued = torch.cat([ids.expand(first.numel(), -1), torch.arange(first.numel())[:, None]], dim=1)
        second = (first[:, None] * warped(target(continued).logits[:, -1], **kwargs)).sum(0)  # p(t2)
        draft_first = warped(drafter(ids).logits[0, -1:], **kwargs)[0]
    assert (draft_first - first).abs().sum() > 0.05  # the draft really is a different distribution

    torch.manual_seed(0)
    counts = torch.zeros(2, first.numel())
    drafted = 0
    for _ in range(SAMPLES):
        with record_speculation() as stats:
            out = target.generate(
                ids,
                assistant_model=drafter,
                do_sample=True,
                max_new_tokens=2,
                cache_implementation=implementation,
                cache_config=cache_config,
                **kwargs,
            )
        drafted += sum(stats.proposed_per_round)
        counts[0, out[0, -2]] += 1
        counts[1, out[0, -1]] += 1
    assert drafted > SAMPLES // 2  # the draft loop really ran and proposed tokens
    for position, probs in enumerate((first, second)):
        stat, df = chi_square(counts[position], probs)
        assert stat < chi_square_quantile(df), f"token {position}: chi2={stat:.1f} with df={df}"


def test_a_biased_sampler_fails_the_test(monkeypatch):
    """The test can fail: a draft loop that hands the acceptance test a distribution other than the one it sampled
    from (here: the unprocessed logits at temperature 0.5) skews the output."""
    original = SparseDraftCandidateGenerator._draft

    def biased(self, args):
        ids, logits = original(self, args)
        return ids, logits * 3.0  # claims a sharper q than the one sampled from

    monkeypatch.setattr(SparseDraftCandidateGenerator, "_draft", biased)
    target, drafter = model_pair("llama", "sdpa", num_assistant_tokens=3, draft_layers=1)
    ids = random_prompt(64, seed=5)
    with torch.no_grad():
        first = target(ids).logits[0, -1].softmax(-1)
    torch.manual_seed(0)
    counts = torch.zeros(first.numel())
    for _ in range(SAMPLES // 2):
        out = target.generate(
            ids, assistant_model=drafter, do_sample=True, top_k=0, max_new_tokens=1,
            cache_implementation="budgeted", cache_config={"budget": 16},
        )  # fmt: skip
        counts[out[0, -2]] += 1
    stat, df = chi_square(counts, first)
    assert stat > chi_square_quantile(df)
