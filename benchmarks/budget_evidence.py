"""Does the KV budget matter? Draft acceptance on the tokens that need long context, per budget and drafter.

    python benchmarks/budget_evidence.py --threads 2 --drafter lambda0=runs/budgetdraft_v20_lambda0/lora_adapter \
        --out benchmarks/results/budget_evidence
    python benchmarks/budget_evidence.py --target runs/far/model --drafter base=D1 --drafter budgetdraft=D2 \
        --only base budgetdraft --tasks copy retrieval prose --contexts 4096 8192 16384 --budgets 256 512 1024

On plain text the bundled drafters accept as much on a sparse cache as on a full one: the text they draft needs
only local context. Here every scored token needs a far one. Two tasks, prompts of `--contexts` tokens:

- `passkey`: a 5-digit pass key hidden at a random depth of the classic filler (the task the target was taught;
  it answers it at 1K-4K), asked for at the end; the scored tokens are the target's own greedy answer;
- `needle`: the same needle and question in held-out prose (the bundled King John, which no bundled model saw) as
  the haystack;
- `copy` / `retrieval` (`hf_budgetdraft.eval.far_context`): a passage of the held-out licence texts seen once and
  begun again a context later (scored: the target's continuation of it), and a fact in a format no bundled model
  trained on (a code worded otherwise, a name, a number inside prose) asked for a context later (scored: the
  target's answer); for a target that reads far context (`--target`, `scripts/train_far_target.py`).

For each prompt the target answers greedily once (its full cache); each drafter then prefills the prompt into the
draft cache a `generate()` call would build — a `DynamicCache` (full) or a `BudgetedCache(budget=B, policy=P)`
(`--policy`; by default BudgetDraft's chunk retrieval, `last_key` proxy) — and reads the target's answer
teacher-forced through that cache. Reported per (task, context, drafter, cache): the answer tokens a round drafting
the answer would keep (the matching prefix; mean and 95% bootstrap interval), per-token agreement (Wilson 95%), the
share of prompts whose needle the budget kept (every needle token in every layer and KV head of the drafter), and
the accepted answer tokens split by kept / not kept; with `--speed-prompts N`, the one-liner's decode speed-up over
plain AR on the first N prompts (`one_liner_speed.py`); with `--roles`, BudgetDraft's claim read as goals with
paired intervals (`budget_goals.py`). `target correct` = the target's answer is the key (the scored
tokens are its answer either way: acceptance is agreement with the target, right or wrong).
Writes `<out>.json` and `<out>.md`. Run it alone: a second busy process on 2 cores stalls torch's threads.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, Cache, DynamicCache

import hf_budgetdraft  # noqa: F401  (registers the cache implementations)
from hf_budgetdraft import BudgetedCache, query_capture
from hf_budgetdraft.cache import POLICIES, get_policy
from hf_budgetdraft.demo import load_demo_models
from hf_budgetdraft.demo.documents import DEMO_TEXT
from hf_budgetdraft.demo.tasks import NEEDLE, passkey_sample
from hf_budgetdraft.eval.far_context import RETRIEVAL_FORMATS, copy_probe, held_out_sources, retrieval_probe
from hf_budgetdraft.eval.metrics import bootstrap_ci
from hf_budgetdraft.runs.intervals import wilson_interval

sys.path.insert(0, str(Path(__file__).resolve().parent))
import budget_goals  # noqa: E402
from one_liner_speed import paired_speeds, summarise_speeds  # noqa: E402
from provenance import run_record, run_text, write_results  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PASSAGE, LEAD = 128, 64  # a copy probe's passage, and the filler before its first sight


@torch.inference_mode()
def target_answer(target, prompt: torch.LongTensor, length: int) -> torch.LongTensor:
    """The target's greedy continuation `(length,)` of `prompt` `(1, L)` on its full cache."""
    out = target.generate(prompt, do_sample=False, max_new_tokens=length, min_new_tokens=length)
    return out[0, prompt.shape[1] :]


@torch.inference_mode()
def draft_agreement(
    drafter, prompt, answer, budget: int | None, policy: str = "chunk", policy_kwargs: dict | None = None
) -> tuple[list[bool], Cache]:
    """Per answer token, whether the drafter's argmax through its draft cache is the target's token; and the cache
    (a budgeted cache holds what its selection kept).

    The prompt `(1, L)` is prefilled as `generate()` prefills it, then the answer `(A,)` is fed as one block (a
    cache returns the same logits to a block as to the same tokens one at a time), or one token at a time where the
    policy selects again with each step's query (dynamic)."""
    if budget is None:
        cache = DynamicCache(config=drafter.config)
    else:
        cache = BudgetedCache(
            config=drafter.config, budget=budget, policy=policy, policy_kwargs=policy_kwargs
        )
    # the prefill's queries, for a policy that scores with them (snapkv), and each step's, for one that re-selects
    with query_capture(drafter):
        first = drafter(prompt, cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1]  # (V,)
        if budget is not None and cache.policy.refreshes:
            steps = [
                drafter(token.view(1, 1), cache=cache, use_cache=True).logits[0] for token in answer[:-1]
            ]
            rest = torch.cat(steps)  # (A - 1, V)
        else:
            rest = drafter(answer[None, :-1], cache=cache, use_cache=True).logits[0]  # (A - 1, V)
    predicted = torch.cat([first.argmax(-1, keepdim=True), rest.argmax(-1)])  # (A,)
    return (predicted == answer).tolist(), cache


def needle_shares(cache, needle: range) -> list[float] | None:
    """Per layer and KV head of a budgeted cache, the share of the needle's positions its selection kept (`None`:
    a full cache, or a policy that selects again at every step, whose last selection says little)."""
    if getattr(getattr(cache, "policy", None), "refreshes", False):
        return None
    layers = [
        layer for layer in getattr(cache, "layers", []) if getattr(layer, "kept_positions", None) is not None
    ]
    if not layers:
        return None
    wanted = torch.tensor(list(needle))
    return [
        float(torch.isin(wanted, layer.kept_positions[0, h]).float().mean())
        for layer in layers
        for h in range(layer.kept_positions.shape[1])
    ]


def accepted_prefix(hits: list[bool]) -> int:
    """Answer tokens a round drafting the whole answer keeps: the leading run of agreements."""
    return next((i for i, hit in enumerate(hits) if not hit), len(hits))


@dataclass
class Probe:
    """One prompt `(1, L)` and what is scored after it: the target's next `answer_length` tokens; for the passkey
    tasks the key's ids and the needle's positions in the prompt (for `copy`: the passage's first sight)."""

    input_ids: torch.LongTensor
    answer_length: int
    key_ids: torch.LongTensor | None = None
    needle: range | None = None


def _held_out_tokens(tokenizer) -> torch.Tensor:
    return tokenizer(DEMO_TEXT.read_text(encoding="utf-8"), return_tensors="pt").input_ids[0]


def far_probes(tokenizer, task: str, context: int, count: int, rng: random.Random):
    """`copy` / `retrieval` probes of about `context` tokens: the prompt ends where the scored tokens begin."""
    filler, passages = held_out_sources(tokenizer)
    formats = sorted(RETRIEVAL_FORMATS)
    for index in range(count):
        offset = rng.randrange(filler.numel() - context)
        needle = None
        if task == "copy":
            start = rng.randrange(passages.numel() - PASSAGE)
            passage = passages[start : start + PASSAGE]
            probe = copy_probe(filler[offset:], passage, max(0, context - LEAD - 2 * PASSAGE), lead=LEAD)
            needle = range(LEAD, LEAD + PASSAGE)  # the passage's first sight
        else:
            name = formats[index % len(formats)]
            probe = retrieval_probe(
                tokenizer, filler[offset:], name, max(0, context - 96), rng.randrange(1 << 30)
            )
        first = int(probe.scored[0])
        key = None if task == "copy" else probe.input_ids[0, first:]
        yield Probe(probe.input_ids[:, :first], probe.input_ids.shape[1] - first, key, needle)


def probes(demo, task: str, context: int, count: int, seed: int, prose_tokens: int):
    """`count` seeded probes of `context` tokens for `task` (passkey, needle, prose, copy or retrieval)."""
    rng = random.Random(f"{task}-{context}-{seed}")
    if task in ("copy", "retrieval"):
        yield from far_probes(demo.tokenizer, task, context, count, rng)
        return
    haystack = None
    if task in ("needle", "prose"):
        haystack = _held_out_tokens(demo.tokenizer)
    for _ in range(count):
        if task == "prose":
            start = rng.randrange(haystack.numel() - context + 1)
            yield Probe(haystack[None, start : start + context], prose_tokens)
            continue
        sample = passkey_sample(
            demo.tokenizer, context, seed=rng.randrange(1 << 30), haystack_ids=haystack, depth=rng.random()
        )
        needle_ids = demo.tokenizer(NEEDLE.format(key=sample.key), add_special_tokens=False).input_ids
        needle = range(sample.needle_position, sample.needle_position + len(needle_ids))
        yield Probe(sample.input_ids, sample.answer_ids.shape[1], sample.answer_ids[0], needle)


def tokens_per_round(hits: list[bool], gamma: int) -> float:
    """Tokens a greedy speculative round emits drafting `gamma` at a time along the target's own text, from
    teacher-forced hits: each round keeps the leading hits (at most `gamma`) plus the target's one token."""
    position, rounds = 0, 0
    while position < len(hits):
        accepted = accepted_prefix(hits[position : position + gamma])
        position += accepted + 1
        rounds += 1
    return len(hits) / rounds


def summarise(rows: list[dict], draws: int) -> dict:
    prefixes = [r["accepted"] for r in rows]
    per_round = [r["tokens_per_round"] for r in rows]
    hits = sum(sum(r["hits"]) for r in rows)
    total = sum(len(r["hits"]) for r in rows)
    out = {
        "prompts": len(rows),
        "accepted": sum(prefixes) / len(prefixes),
        "accepted_ci": bootstrap_ci(prefixes, np.mean, draws=draws, vectorized=True),
        "agreement": hits / total,
        "agreement_ci": wilson_interval(hits, total),
        "answer_tokens": total / len(rows),
        "tokens_per_round": sum(per_round) / len(per_round),
        "tokens_per_round_ci": bootstrap_ci(per_round, np.mean, draws=draws, vectorized=True),
        "per_prompt_tokens_per_round": per_round,  # in prompt order, the same prompts in every cell
    }
    kept = [r for r in rows if r["kept"] is not None]
    if kept:
        inside = [r["accepted"] for r in kept if r["kept"]]
        outside = [r["accepted"] for r in kept if not r["kept"]]
        out["needle_kept"] = len(inside) / len(kept)
        out["needle_share"] = float(np.mean([r["share"] for r in kept]))
        out["accepted_kept"] = sum(inside) / len(inside) if inside else None
        out["accepted_dropped"] = sum(outside) / len(outside) if outside else None
    return out


def bundled_like(demo, adapter: Path):
    """A LoRA adapter trained on the bundled base drafter, merged as the bundle merges its own: adapter weights
    rounded to bfloat16 (the bundle stores them so), merged into the bundled base drafter."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(copy.deepcopy(demo.base_drafter), adapter, local_files_only=True)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(param.to(torch.bfloat16).to(param.dtype))
    return model.merge_and_unload().eval()


def load_drafters(demo, extra: list[str]) -> dict:
    """The bundled drafters and each `NAME=PATH` (a LoRA adapter folder, or a full model)."""
    drafters = {"base": demo.base_drafter, "bundled": demo.drafter, "sampling": demo.sampling_drafter}
    drafters["target"] = demo.target  # a "drafter" that does read far context (only with --only target)
    for item in extra:
        name, _, path = item.partition("=")
        if not path:
            raise ValueError(f"--drafter takes NAME=PATH, got {item!r}")
        if (Path(path) / "adapter_config.json").is_file():
            drafters[name] = bundled_like(demo, Path(path))
        else:
            drafters[name] = AutoModelForCausalLM.from_pretrained(path, use_safetensors=True).eval()
    return drafters


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--budgets", type=int, nargs="+", default=[32, 64, 128, 256, 512])
    parser.add_argument(
        "--tasks",
        nargs="+",
        default=["passkey", "needle"],
        choices=["passkey", "needle", "prose", "copy", "retrieval"],
    )
    parser.add_argument(
        "--target",
        type=Path,
        help="a target folder instead of the bundled one (same tokenizer), e.g. a far target",
    )
    parser.add_argument(
        "--prose-tokens", type=int, default=64, help="target tokens scored after a prose prompt"
    )
    parser.add_argument(
        "--policy", default="chunk", choices=sorted(POLICIES), help="the budgeted caches' selection policy"
    )
    parser.add_argument(
        "--policy-kwargs",
        type=json.loads,
        default=None,
        help="the policy's hyper-parameters as JSON, e.g. '{\"components\": 8}' for dynamic",
    )
    parser.add_argument("--gamma", type=int, default=6, help="draft length of the tokens-a-round column")
    parser.add_argument("--prompts", type=int, default=40, help="prompts per task and context")
    parser.add_argument(
        "--drafter", action="append", default=[], help="NAME=PATH: another drafter to compare"
    )
    parser.add_argument(
        "--only",
        nargs="+",
        default=None,
        help="evaluate only these drafters (base, bundled, sampling, target: the target on a draft cache, or a NAME)",
    )
    parser.add_argument(
        "--speed-prompts",
        type=int,
        default=0,
        help="also time the one-liner against plain AR on the first N prompts of each task and context",
    )
    parser.add_argument("--speed-tokens", type=int, default=64, help="tokens each timed call decodes")
    parser.add_argument(
        "--roles",
        nargs="+",
        default=None,
        help="base=NAME budgetdraft=NAME lambda0=NAME: also judge BudgetDraft's claim (budget_goals.py)",
    )
    parser.add_argument(
        "--goal-budgets",
        type=int,
        nargs="+",
        default=list(budget_goals.GOAL_BUDGETS),
        help="budgets --roles reads",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--bootstrap-draws", type=int, default=2000)
    parser.add_argument("--out", type=Path, default=RESULTS / "budget_evidence")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    roles = budget_goals.parse_roles(args.roles) if args.roles else None
    get_policy(args.policy, **(args.policy_kwargs or {}))  # a bad hyper-parameter fails now, not an hour in
    torch.set_num_threads(args.threads)
    started = time.time()
    demo = load_demo_models()
    if args.target is not None:
        target = AutoModelForCausalLM.from_pretrained(args.target, use_safetensors=True).eval()
        demo = dataclasses.replace(demo, target=target)
    drafters = load_drafters(demo, args.drafter)
    wanted = args.only or [name for name in drafters if name != "target"]
    unknown = sorted(set(wanted) - set(drafters))
    if unknown:
        raise ValueError(f"--only got unknown drafters {unknown}; known: {sorted(drafters)}")
    drafters = {name: drafters[name] for name in wanted}
    if roles is not None and not set(roles.values()) <= set(drafters):
        raise ValueError(
            f"--roles names {sorted(set(roles.values()) - set(drafters))}, not among {sorted(drafters)}"
        )
    caches = [None, *args.budgets]
    rows: dict[tuple, list[dict]] = {}
    retrieved: dict[tuple, list[bool]] = {}
    speeds: dict[tuple, list[dict]] = {}
    for task in args.tasks:
        for context in args.contexts:
            prompts = probes(demo, task, context, args.prompts, args.seed, args.prose_tokens)
            for index, probe in enumerate(prompts):
                if index < args.speed_prompts:
                    timed = paired_speeds(
                        demo.target,
                        drafters,
                        probe.input_ids,
                        args.speed_tokens,
                        caches,
                        args.policy,
                        args.policy_kwargs,
                    )
                    for (name, budget), row in timed.items():
                        speeds.setdefault((task, context, name, budget), []).append(row)
                answer = target_answer(demo.target, probe.input_ids, probe.answer_length)
                if probe.key_ids is not None:
                    retrieved.setdefault((task, context), []).append(bool(torch.equal(answer, probe.key_ids)))
                for name, drafter in drafters.items():
                    for budget in caches:
                        hits, cache = draft_agreement(
                            drafter, probe.input_ids, answer, budget, args.policy, args.policy_kwargs
                        )
                        shares = needle_shares(cache, probe.needle) if probe.needle else None
                        rows.setdefault((task, context, name, budget), []).append(
                            {
                                "hits": hits,
                                "accepted": accepted_prefix(hits),
                                "tokens_per_round": tokens_per_round(hits, args.gamma),
                                # the needle kept whole by every layer and KV head, and its mean share kept
                                "kept": None if shares is None else min(shares) == 1.0,
                                "share": None if shares is None else float(np.mean(shares)),
                            }
                        )
            print(f"{task} @{context}: {time.time() - started:.0f} s", flush=True)
    results = [
        {
            "task": t,
            "context": c,
            "drafter": d,
            "cache": "full" if b is None else f"B={b}",
            "target_correct": sum(retrieved[t, c]) / len(retrieved[t, c]) if (t, c) in retrieved else None,
            **summarise(r, args.bootstrap_draws),
            **(summarise_speeds(speeds[t, c, d, b]) if (t, c, d, b) in speeds else {}),
        }
        for (t, c, d, b), r in rows.items()
    ]
    command = "python benchmarks/budget_evidence.py " + " ".join(sys.argv[1:] if argv is None else argv)
    meta = {"command": command, **run_record(args.threads), "seconds": round(time.time() - started)}
    report = {"meta": meta, "results": results}
    table = markdown(results, args, meta)
    if roles is not None:
        report["goals"] = budget_goals.goals(results, roles, args.bootstrap_draws, args.goal_budgets)
        table += "\n" + budget_goals.markdown(report["goals"], roles)
    write_results(args.out, report, table)


def _interval(low_high) -> str:
    return f"[{low_high[0]:.2f}, {low_high[1]:.2f}]"


def _number(value, digits: int = 2) -> str:
    return "" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def markdown(results: list[dict], args, meta: dict) -> str:
    timed = any("speedup" in r for r in results)
    head = (
        "# Draft acceptance on tokens that need long context, per KV budget\n\n"
        f"`{meta['command']}` — {args.prompts} prompts per task and "
        f"context, {args.threads} threads, CPU fp32, {run_text(meta)}, policy `{args.policy}`"
        f"{f' {json.dumps(args.policy_kwargs)}' if args.policy_kwargs else ''}. "
        "`accepted` = answer tokens a round drafting the whole answer keeps, 95% bootstrap interval; `agreement` = "
        f"per answer token (Wilson 95%); `a round (γ={args.gamma})` = tokens a greedy round drafting {args.gamma} "
        "emits along the target's answer; `needle share` = mean share of the needle's positions (for `copy`: the "
        "passage's first sight) each layer and KV head kept; `needle kept` = share of prompts whose needle every "
        "layer and KV head "
        "kept; `kept` / `dropped` = mean accepted answer tokens on those prompts."
    )
    if timed:
        head += (
            f" `one-liner` = the one-liner with its defaults on the first {args.speed_prompts} prompts, "
            f"{args.speed_tokens} tokens each (`one_liner_speed.py`): decode speed-up over plain AR on the same "
            "prompt, timed just before and after each call (median [min, max]), the share of outputs identical to "
            "AR's, its tokens a round; on a full cache, the budget is the prompt's length."
        )
    columns = (
        "task | context | target correct | drafter | cache | answer tokens | accepted | agreement | a round"
    )
    columns += " | needle share | needle kept | kept | dropped"
    columns += " | one-liner speed-up | identical | one-liner a round" if timed else ""
    lines = [f"{head}\n\n| {columns} |", "|" + "---|" * (columns.count("|") + 1)]
    for r in results:
        line = (
            f"| {r['task']} | {r['context']} | {_percent(r['target_correct'])} | {r['drafter']} | {r['cache']} | "
            f"{r['answer_tokens']:.0f} | {r['accepted']:.2f} {_interval(r['accepted_ci'])} | {r['agreement']:.2f} "
            f"{_interval(r['agreement_ci'])} | {r['tokens_per_round']:.2f} {_interval(r['tokens_per_round_ci'])} | "
            f"{_number(r.get('needle_share'))} | {_number(r.get('needle_kept'))} | {_number(r.get('accepted_kept'))} | "
            f"{_number(r.get('accepted_dropped'))} |"
        )
        if timed:
            line += (
                f" {r['speedup']:.2f}x {_interval(r['speedup_range'])} | {r['identical']:.0%} | "
                f"{_number(r['one_liner_tokens_per_round'])} |"
                if "speedup" in r
                else " | | |"
            )
        lines.append(line)
    return "\n".join(lines) + "\n"


def _percent(value) -> str:
    return "" if value is None else f"{value:.0%}"


if __name__ == "__main__":
    main()
