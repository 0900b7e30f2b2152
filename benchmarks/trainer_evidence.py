"""Before/after BudgetDraft training: drafter-target greedy agreement and mean accepted length through `generate()`
at 2 context lengths x 3 budgets. Writes `trainer_evidence.json` and `trainer_evidence.md` to `--output-dir`.

With `--target`/`--drafter` it trains a given pair (e.g. the bundled demo models) on `--data_files`; without, it
builds a small *structured random* Llama pair offline (large init, sharpened head and damped attention output, as
`tests/tiny_models.py` explains, so greedy continuations do not collapse into loops) and a drafter made of the
target's first layers plus its head. Training rows are a random prefix followed by the target's own greedy
continuation, which is what a drafter sees during speculative decoding.

    python benchmarks/trainer_evidence.py --output-dir bench-out/trainer --steps 300 --threads 1
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import re
import sys
import time
from pathlib import Path

import datasets
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from hf_budgetdraft import record_speculation
from hf_budgetdraft.trainer import (
    BudgetDraftConfig,
    BudgetDraftTrainer,
    load_text_dataset,
    pack_dataset,
    precompute_teacher_targets,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import run_record, run_text, write_results  # noqa: E402


def first_layers(target, num_layers: int):
    """A drafter made of the target's first `num_layers` layers plus its embeddings, final norm and head."""
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = num_layers
    if hasattr(config, "first_k_dense_replace"):  # GLM-4-style: keep every kept layer dense, as in the target
        config.first_k_dense_replace = min(config.first_k_dense_replace, num_layers)
    drafter = type(target)(config)
    drafter.load_state_dict({k: v for k, v in target.state_dict().items() if k in drafter.state_dict()})
    return drafter.eval()


def structured_random_pair(seed: int, vocab: int, target_layers: int, draft_layers: int):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=target_layers,
        max_position_embeddings=4096,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    target = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(3.0)
        for name, param in target.named_parameters():
            if re.search(r"self_attn\.o_proj\.weight$", name):
                param.mul_(0.03)
    return target, first_layers(target, draft_layers)


@torch.no_grad()
def self_distillation_rows(target, count: int, prefix: int, continuation: int, seed: int) -> datasets.Dataset:
    """Random prefixes followed by the target's greedy continuation (the tokens a drafter drafts in deployment)."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(count):
        ids = torch.randint(0, target.config.vocab_size, (1, prefix), generator=generator)
        out = target.generate(ids, do_sample=False, max_new_tokens=continuation, min_new_tokens=continuation)
        rows.append(out[0].tolist())
    return datasets.Dataset.from_dict({"input_ids": rows})


def measure(target, drafter, args, budgets, prompts) -> dict:
    """Mean accepted length (tokens per verification round) per (context, budget) through generate()."""
    config = drafter.generation_config
    config.num_assistant_tokens, config.num_assistant_tokens_schedule = args.gamma, "constant"
    config.assistant_confidence_threshold = 0.0
    results = {}
    for context, context_prompts in prompts.items():
        for budget in budgets:
            cache_config = {"budget": budget, "policy": args.policy, "window_length": args.window_length}
            with torch.no_grad(), record_speculation() as stats:
                for ids in context_prompts:
                    target.generate(
                        ids,
                        assistant_model=drafter,
                        do_sample=False,
                        max_new_tokens=args.new_tokens,
                        min_new_tokens=args.new_tokens,
                        cache_implementation="budgeted",
                        cache_config=cache_config,
                    )
            results[f"{context}/{budget}"] = {
                "mean_accepted_length": stats.mean_accepted_length,
                "acceptance_rate": stats.acceptance_rate,
                "rounds": stats.rounds,
            }
    return results


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--output-dir", type=Path, default=Path("bench-out/trainer"))
    parser.add_argument("--target", help="target folder (default: a structured random pair)")
    parser.add_argument(
        "--drafter", help="drafter folder (default: the target's first --draft_layers layers)"
    )
    parser.add_argument("--data_files", nargs="*", help="training text (files/folders) for --target")
    parser.add_argument("--eval_files", nargs="*", help="held-out text for --target (prompts and agreement)")
    parser.add_argument("--text_column", default="text")
    parser.add_argument("--contexts", type=int, nargs=2, default=[256, 512])
    parser.add_argument("--budgets", type=int, nargs=3, default=[32, 64, 128])
    parser.add_argument("--continuation", type=int, default=32)
    parser.add_argument("--window_length", type=int, default=32)
    parser.add_argument("--policy", default="chunk")
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--new_tokens", type=int, default=48)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per context length")
    parser.add_argument("--rows", type=int, default=256, help="training rows")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--learning_rate", type=float, default=3e-4)
    parser.add_argument("--views_per_step", type=int, default=2)
    parser.add_argument("--draft_layers", type=int, default=2, help="drafter = the target's first N layers")
    parser.add_argument("--compare_full_only", action="store_true", help="also train with λ = 0 (ablation)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def pair_from_folders(args, prefix: int):
    """`(target, drafter, training rows, 16 held-out rows, prompts per context, the pair's description)` of
    `--target` (and `--drafter`, else the target's first `--draft_layers` layers) on `--data_files` / `--eval_files`."""
    target = AutoModelForCausalLM.from_pretrained(args.target).eval()
    if args.drafter:
        drafter = AutoModelForCausalLM.from_pretrained(args.drafter).eval()
    else:
        drafter = first_layers(target, args.draft_layers)
    tokenizer = AutoTokenizer.from_pretrained(args.target)

    def text_rows(files, count):
        documents = load_text_dataset(data_files=files, text_column=args.text_column)
        packed = pack_dataset(documents, tokenizer, prefix + args.continuation, text_column=args.text_column)
        return packed.shuffle(seed=args.seed).select(range(min(count, len(packed))))

    rows = text_rows(args.data_files, args.rows)
    held_out = text_rows(args.eval_files, 16 + args.prompts)
    eval_ids = torch.tensor(held_out["input_ids"][16:])  # prompts: the ends of other held-out windows
    held_out = held_out.select(range(16))
    prompts = {
        c: [eval_ids[i : i + 1, prefix - c : prefix] for i in range(len(eval_ids))] for c in args.contexts
    }
    pair = f"{args.target} / {args.drafter or f'its first {args.draft_layers} layers + head'}"
    return target, drafter, rows, held_out, prompts, pair


def structured_pair(args, prefix: int, generator):
    """The same six as `pair_from_folders`, for the structured random pair trained on its own continuations."""
    target, drafter = structured_random_pair(
        args.seed, vocab=256, target_layers=4, draft_layers=args.draft_layers
    )
    rows = self_distillation_rows(target, args.rows, prefix, args.continuation, args.seed)
    held_out = self_distillation_rows(target, 16, prefix, args.continuation, args.seed + 1)
    vocab = target.config.vocab_size
    prompts = {
        c: [torch.randint(0, vocab, (1, c), generator=generator) for _ in range(args.prompts)]
        for c in args.contexts
    }
    pair = f"structured random Llama: target 4 layers, drafter = its first {args.draft_layers} layers + head"
    return target, drafter, rows, held_out, prompts, pair


def training_runs(args, prefix: int) -> dict[str, BudgetDraftConfig]:
    """The BudgetDraft run and, with `--compare_full_only`, its λ = 0 ablation (the same steps with L_A only)."""
    config = BudgetDraftConfig(
        output_dir=str(args.output_dir / "run"),
        prefix_length=prefix,
        continuation_length=args.continuation,
        budgets=list(args.budgets),
        budget_weights=[0.4, 0.3, 0.3],
        views_per_step=args.views_per_step,
        policy=args.policy,
        window_length=args.window_length,
        learning_rate=args.learning_rate,
        warmup_steps=min(30, args.steps // 10),
        max_steps=args.steps,
        per_device_train_batch_size=2,
        logging_steps=max(1, args.steps // 10),
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=args.seed,
    )
    runs = {"budgetdraft": config}
    if args.compare_full_only:  # ablation: conventional full-cache distillation
        runs["full_only"] = dataclasses.replace(
            config, sparse_loss_weight=0.0, output_dir=str(args.output_dir / "full_only")
        )
    return runs


def markdown_tables(evals: dict, accept: dict, names: list[str], args) -> tuple[list[str], list[str]]:
    """`(teacher-forced agreement per branch, mean accepted length per context and budget)` as table lines."""
    agreement_table = [
        "| teacher-forced greedy agreement | " + " | ".join(names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for branch in ["full", *(f"budget_{b}" for b in args.budgets)]:
        key = f"eval_agreement/{branch}"
        agreement_table.append(f"| {branch} | " + " | ".join(f"{evals[n][key]:.3f}" for n in names) + " |")
    accept_table = [
        "| context | budget | "
        + " | ".join(f"accept len {n}" for n in names)
        + " | BudgetDraft vs untrained |",
        "|---:|---:|" + "---:|" * (len(names) + 1),
    ]
    for context in args.contexts:
        for budget in args.budgets:
            values = [accept[n][f"{context}/{budget}"]["mean_accepted_length"] for n in names]
            gain = values[names.index("budgetdraft")] / values[0] - 1
            accept_table.append(
                f"| {context} | {budget} | " + " | ".join(f"{v:.2f}" for v in values) + f" | {gain:+.0%} |"
            )
    return agreement_table, accept_table


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    prefix = max(args.contexts)

    started = time.perf_counter()
    generator = torch.Generator().manual_seed(args.seed + 2)
    if args.target:
        target, drafter, rows, held_out, prompts, pair = pair_from_folders(args, prefix)
    else:
        target, drafter, rows, held_out, prompts, pair = structured_pair(args, prefix, generator)
    # the teacher is the expensive part: its targets are computed once and reused every epoch
    rows = precompute_teacher_targets(rows, target, prefix, args.continuation, batch_size=2)

    variants = {"untrained": copy.deepcopy(drafter)}
    evals, accept = {}, {}
    for name, run_config in training_runs(args, prefix).items():
        trainer = BudgetDraftTrainer(
            model=copy.deepcopy(variants["untrained"]),
            teacher=target,
            args=run_config,
            train_dataset=rows,
            eval_dataset=held_out,
        )
        if "untrained" not in evals:
            evals["untrained"] = trainer.evaluate()
        trainer.train()
        evals[name] = trainer.evaluate()
        variants[name] = trainer.model.eval()
    for name, model in variants.items():
        accept[name] = measure(target, model, args, args.budgets, prompts)

    agreement_table, accept_table = markdown_tables(evals, accept, list(variants), args)
    record = {
        "pair": pair,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "teacher_forced": evals,
        "generate": accept,
        "seconds": time.perf_counter() - started,
        **run_record(args.threads),
    }
    summary = (
        f"Pair: {pair}. Training: {args.steps} steps, prefix {prefix} + continuation {args.continuation}, budgets "
        f"{args.budgets} (weights 0.4/0.3/0.3), policy {args.policy}, {args.views_per_step} views/step, lr "
        f"{args.learning_rate}; full_only = the same run with λ = 0 (L_A only). Agreement: teacher-forced on 16 "
        f"held-out rows at prefix {prefix}. Accept len: mean accepted length (tokens per verification round) "
        f"through generate(cache_implementation='budgeted'), gamma={args.gamma}, {args.prompts} held-out prompts x "
        f"{args.new_tokens} new tokens, greedy. {args.threads} threads, {run_text(record)}."
    )
    text = summary + "\n\n" + "\n".join(agreement_table) + "\n\n" + "\n".join(accept_table) + "\n"
    write_results(args.output_dir / "trainer_evidence", record, text)


if __name__ == "__main__":
    main()
