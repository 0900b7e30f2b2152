"""The one-liner's decode speed on a prompt, paired with plain AR on the same prompt: the speed columns of
`budget_evidence.py`.

For one prompt, the target decodes `new_tokens` greedily on its own (transformers' default cache: the reference),
then, for each drafter and cache, the one-liner with its defaults (`generate(ids, assistant_model=drafter,
cache_implementation="budgeted", cache_config={"budget": B, "policy": P})`; the full-cache row is the same call with
the budget at the prompt's length and a window holding every new token, so the drafter keeps all it reads) followed
by the target alone again. A call's speed-up is its decode throughput (after the first emitted chunk; the whole
call's when that chunk held every token) over the mean of the two AR calls just before and after it: this machine's
AR speed drifts by tens of percent within minutes, so each call is compared with the AR of its own moment, not with
AR timed once before and once after every call of the prompt. Its output must be the reference's, token for token.
"""

from __future__ import annotations

import statistics

import torch

from hf_budgetdraft.generation.spec import DraftSpec
from hf_budgetdraft.runs.timed_call import timed_generate


def one_liner_kwargs(
    drafter,
    budget: int | None,
    prompt_length: int,
    new_tokens: int,
    policy: str = "chunk",
    policy_kwargs: dict | None = None,
) -> dict:
    """`generate()` arguments of the one-liner with its defaults at `budget` (`None`: every prompt token kept,
    and a recent window of at least `new_tokens`: the draft cache drops nothing in the call)."""
    if budget is None:
        config = {
            "budget": prompt_length,
            "window_length": max(DraftSpec(cache="budgeted").window_length, new_tokens),
        }
    else:
        config = {"budget": budget, "policy": policy, "policy_kwargs": policy_kwargs}
    return dict(assistant_model=drafter, cache_implementation="budgeted", cache_config=config)


def decode_rate(run) -> float:
    """Tokens per second after the first emitted chunk, or over the whole call when that chunk held them all."""
    return run.decode_tokens_per_second or run.tokens_per_second


def paired_speeds(
    target,
    drafters: dict,
    prompt: torch.LongTensor,
    new_tokens: int,
    budgets: list[int | None],
    policy: str = "chunk",
    policy_kwargs: dict | None = None,
) -> dict[tuple[str, int | None], dict]:
    """Per `(drafter name, budget)`: `speedup` over AR, `decode_tokens_per_s`, `identical` (bool: the output is
    the reference's), `tokens_per_round` (accepted draft tokens a round + the target's own; `None` without
    rounds) and `ar_rounds` (rounds the draft-length policy ran as plain AR steps). `prompt` `(1, L)`."""
    ar_runs = [timed_generate(target, prompt, new_tokens)]  # ar_runs[i], ar_runs[i + 1]: around call i
    runs = {}
    for name, drafter in drafters.items():
        for budget in budgets:
            kwargs = one_liner_kwargs(drafter, budget, prompt.shape[1], new_tokens, policy, policy_kwargs)
            runs[(name, budget)] = timed_generate(target, prompt, new_tokens, **kwargs)
            ar_runs.append(timed_generate(target, prompt, new_tokens))
    speeds = {}
    for index, (key, run) in enumerate(runs.items()):
        ar = statistics.mean([decode_rate(ar_runs[index]), decode_rate(ar_runs[index + 1])])
        speeds[key] = {
            "speedup": decode_rate(run) / ar,
            "decode_tokens_per_s": decode_rate(run),
            "ar_decode_tokens_per_s": ar,
            "identical": bool(torch.equal(run.new_ids, ar_runs[0].new_ids)),
            "tokens_per_round": run.stats.mean_accepted_length if run.stats.rounds else None,
            "ar_rounds": run.stats.ar_rounds,
        }
    return speeds


def summarise_speeds(rows: list[dict]) -> dict:
    """Median speed-up (with its range), share of identical outputs and mean tokens a round over prompts."""
    speedups = sorted(r["speedup"] for r in rows)
    per_round = [r["tokens_per_round"] for r in rows if r["tokens_per_round"] is not None]
    return {
        "speed_prompts": len(rows),
        "speedup": statistics.median(speedups),
        "speedup_range": [speedups[0], speedups[-1]],
        "identical": sum(r["identical"] for r in rows) / len(rows),
        "one_liner_tokens_per_round": statistics.mean(per_round) if per_round else None,
        "ar_rounds": sum(r["ar_rounds"] for r in rows),
    }
