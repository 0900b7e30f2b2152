"""The ceiling of any draft-length policy: how fast speculation with the bundled drafter can be on this machine.

    python benchmarks/ceiling.py --threads 2 --contexts 4096 8192 16384 --passages 2

A speculative round that drafts γ tokens emits `1 + sum_{k<=γ} S_k` tokens in expectation (`S_k`: the chance that
the first k draft tokens are all accepted) and costs `c_verify(γ + 1) + c_draft(γ)`, against `c_verify(1)` a plain AR
step. So no policy, adaptive or fixed, decodes faster than `max_γ (1 + sum S_k) · c_verify(1) / (c_verify(γ + 1) +
c_draft(γ))` times plain AR (Leviathan et al., arXiv 2211.17192, §3.4, with measured per-position acceptance and a
measured verification curve instead of a linear one). Per (text, context, passage), in one process:

- `c_verify(n)`: the fast target (`budgetdraft_sdpa`, `GrowableCache`, few-row linear layers) forwarding n = 1 ...
  `max_gamma + 1` tokens after the prompt, interleaved repeats, medians;
- `c_draft(γ) = a + b·γ`: fitted from two one-liner calls with a fixed draft length (`max_gamma` and 2), their
  rounds' draft times (the catch-up on the verified tokens included);
- `S_k`: from the `max_gamma` call's accepted counts (greedy drafts are deterministic, so a γ-round accepts
  `min(A, γ)` of what a `max_gamma`-round accepts; a sampled round draws its first γ tokens alike);
- measured: the README's one-liner against fast AR, interleaved, in the same process.

Greedy uses the bundled `drafter`, sampling (T = 0.8) the `sampling_drafter`. `alpha needed`: the acceptance a
drafter would need at every position (same costs) for the ceiling to reach `--goal` (greedy) or `--sampling-goal`.
Writes `benchmarks/results/ceiling.{json,md}`. Run it alone: a second busy process stalls torch's threads.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

import torch

from hf_budgetdraft.cache import GrowableCache
from hf_budgetdraft.demo import load_demo_models
from hf_budgetdraft.eval.batched_bench import number_text
from hf_budgetdraft.eval.runners import run_ar, run_assisted
from hf_budgetdraft.eval.speedup_model import alpha_needed, expected_speedup, survival
from hf_budgetdraft.runs.timed_call import ar_setup

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fast_default import RESULTS, passage_offsets, texts  # noqa: E402
from provenance import run_record, run_text, write_results  # noqa: E402
from verify_cost import time_forward  # noqa: E402

TEMPERATURE = 0.8
CALLS_A_REPEAT = 5  # back-to-back forwards of one length, their median one sample


@torch.no_grad()
def verify_costs(target, ids: torch.LongTensor, max_tokens: int, repeats: int) -> list[float]:
    """Seconds of the fast target forwarding n = 1 ... `max_tokens` tokens after `ids` `(1, P)`; index n - 1."""
    past = ids.shape[1] - max_tokens
    with ar_setup(target, "fast", ids.shape[1]) as kwargs:
        cache: GrowableCache = kwargs["cache"]
        target(input_ids=ids[:, :past], cache=cache, use_cache=True, logits_to_keep=1)
        times = [[] for _ in range(max_tokens)]
        for repeat in range(repeats + 1):
            order = range(1, max_tokens + 1) if repeat % 2 else range(max_tokens, 0, -1)
            for n in order:
                tokens = ids[:, past : past + n]
                calls = [time_forward(target, cache, tokens, past, inner=1) for _ in range(CALLS_A_REPEAT)]
                if repeat:  # the first pass warms every path
                    times[n - 1].append(statistics.median(calls))
    return [statistics.median(t) for t in times]


def fixed_length_call(demo, ids, gamma: int, new_tokens: int, do_sample: bool) -> tuple[list[int], float]:
    """One one-liner call drafting exactly γ tokens a round: the rounds' accepted counts and median draft seconds
    (the first round, holding both prefills, and a last round cut short by the token limit left out)."""
    sampling = {"temperature": TEMPERATURE} if do_sample else None
    torch.manual_seed(0)
    result = run_assisted(
        demo.target,
        demo.drafter_for(do_sample),
        ids,
        new_tokens,
        None,
        "budgeted",
        {"draft_length": gamma, "compile": False},  # the eager lean step a single call drafts with
        sampling=sampling,
    )
    stats = result.stats
    rounds = zip(
        stats.accepted_per_round[1:],
        stats.proposed_per_round[1:],
        stats.draft_seconds_per_round[1:],
        strict=True,
    )
    full = [(accepted, seconds) for accepted, proposed, seconds in rounds if proposed == gamma]
    return [accepted for accepted, _ in full], statistics.median(seconds for _, seconds in full)


def measured_ratio(demo, ids, new_tokens: int, do_sample: bool, repeats: int) -> list[float]:
    """The one-liner's decode speed over fast AR, paired per repeat (sampling: both seeded alike). The drafter is a
    fresh copy, so no draft step compiled for earlier cells (its compile-when-it-pays rule) flatters it."""
    sampling = {"temperature": TEMPERATURE} if do_sample else None
    drafter = copy.deepcopy(demo.drafter_for(do_sample))
    ratios = []
    for _ in range(repeats):
        torch.manual_seed(1)
        ar = run_ar(demo.target, ids, new_tokens, "fast", sampling)
        torch.manual_seed(1)
        spec = run_assisted(demo.target, drafter, ids, new_tokens, None, "budgeted", {}, sampling=sampling)
        ratios.append(spec.decode_tokens_per_second / ar.decode_tokens_per_second)
    return ratios


def cell(demo, ids, args, do_sample: bool, verify: list[float]) -> dict:
    top = args.max_gamma
    accepted, draft_top = fixed_length_call(demo, ids, top, args.new_tokens, do_sample)
    _, draft_two = fixed_length_call(demo, ids, 2, args.new_tokens, do_sample)
    draft_b = max(0.0, (draft_top - draft_two) / (top - 2))
    draft_a = max(0.0, draft_two - 2 * draft_b)
    survive = survival(accepted, top)
    curve = [expected_speedup(survive, verify, draft_a, draft_b, g) for g in range(top + 1)]
    best = max(range(top + 1), key=curve.__getitem__)
    free = max(expected_speedup(survive, verify, 0.0, 0.0, g) for g in range(top + 1))
    goal = args.sampling_goal if do_sample else args.goal
    ratios = measured_ratio(demo, ids, args.new_tokens, do_sample, args.repeats)
    return {
        "mode": f"T{TEMPERATURE}" if do_sample else "greedy",
        "survival": survive,
        "tokens_a_round_at_max_gamma": 1 + sum(survive),
        "verify_ms": [1e3 * v for v in verify],
        "draft_ms_intercept": 1e3 * draft_a,
        "draft_ms_per_token": 1e3 * draft_b,
        "ceiling_by_gamma": curve,
        "best_gamma": best,
        "ceiling": curve[best],
        "ceiling_free_draft": free,
        "measured_oneliner_vs_fast_ar": statistics.median(ratios),
        "measured_runs": ratios,
        "goal": goal,
        "alpha_needed": alpha_needed(goal, verify, draft_a, draft_b),
    }


def markdown(rows: list[dict], meta: dict) -> str:
    num = number_text
    lines = [
        "# The ceiling of any draft-length policy with the bundled drafters",
        "",
        f"`{meta['command']}` — {meta['threads']} threads, run alone, {run_text(meta)}. "
        "Ceiling = max over γ of `(1 + sum S_k) · c_verify(1) / (c_verify(γ+1) + c_draft(γ))`, all measured in "
        "the same process (see the script's docstring); `free draft` = the same with drafting free; measured = "
        "the one-liner over fast AR in that process (median of the paired repeats).",
        "",
        "| text | context | offset | mode | tokens a round at γ max | c_verify(1) / (γ+1) ms | draft ms: a + b·γ | "
        "best γ | ceiling vs fast AR | free draft | one-liner measured | goal | α needed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        g = r["best_gamma"]
        lines.append(
            f"| {r['text']} | {r['context']} | {r['offset']} | {r['mode']} | "
            f"{num(r['tokens_a_round_at_max_gamma'], 2)} | {num(r['verify_ms'][0], 2)} / {num(r['verify_ms'][g], 2)} | "
            f"{num(r['draft_ms_intercept'], 2)} + {num(r['draft_ms_per_token'], 2)}·γ | {g} | "
            f"{num(r['ceiling'], 2)} | {num(r['ceiling_free_draft'], 2)} | "
            f"{num(r['measured_oneliner_vs_fast_ar'], 2)} | {r['goal']} | "
            f"{'> 1' if r['alpha_needed'] is None else num(r['alpha_needed'], 2)} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--passages", type=int, default=2)
    parser.add_argument("--texts", nargs="+", default=["king_john", "licences"])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--max-gamma", type=int, default=10)
    parser.add_argument("--verify-repeats", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2, help="paired one-liner / fast AR runs a cell")
    parser.add_argument("--goal", type=float, default=1.8, help="greedy goal over fast AR")
    parser.add_argument("--sampling-goal", type=float, default=1.3, help="sampling goal over AR sampling")
    parser.add_argument("--out", type=Path, default=RESULTS / "ceiling")
    args = parser.parse_args()
    if not 2 < args.max_gamma <= 16:
        raise ValueError(f"--max-gamma must be in 3..16, got {args.max_gamma}")
    torch.set_num_threads(args.threads)
    demo = load_demo_models()
    meta = {"command": "python benchmarks/ceiling.py " + " ".join(sys.argv[1:]), **run_record(args.threads)}
    rows = []
    for name, ids in texts(demo.tokenizer).items():
        if name not in args.texts:
            continue
        for context in args.contexts:
            for offset in passage_offsets(ids.shape[1], context, args.new_tokens, args.passages):
                prompt = ids[:, offset : offset + context]
                verify = verify_costs(demo.target, prompt, args.max_gamma + 1, args.verify_repeats)
                for do_sample in (False, True):
                    row = {"text": name, "context": context, "offset": offset}
                    row.update(cell(demo, prompt, args, do_sample, verify))
                    rows.append(row)
                    print(markdown([row], meta).splitlines()[-1], flush=True)
    write_results(args.out, {"meta": meta, "rows": rows}, markdown(rows, meta))


if __name__ == "__main__":
    main()
