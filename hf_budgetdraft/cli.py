"""`hf-budgetdraft` command line. Sub-commands: `generate` (speculative generation with a sparse draft cache,
checked token-for-token against the target's own greedy output); `train` (BudgetDraft training of a drafter
against a frozen target, see `hf_budgetdraft.trainer`); `bench` (every decoding method on long-context tasks:
greedy-diff losslessness, acceptance, speed-up, phase costs, memory; see `hf_budgetdraft.eval`); `demo` (the Gradio
app on 127.0.0.1, see `hf_budgetdraft.app`)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Literal

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser

from .app import AppArguments, demo_command
from .attention.varlen import NAME as VARLEN_NAME
from .cache.base import MAX_CACHE_TOKENS
from .demo.documents import DEMO_TEXT
from .eval.bench import BenchArguments, bench_command
from .eval.runners import run_ar, run_assisted
from .random_models import random_pair
from .trainer.config import BudgetDraftConfig


@dataclass
class GenerateArguments:
    target: str | None = field(
        default=None, metadata={"help": "Local HF model folder of the target (safetensors)."}
    )
    drafter: str | None = field(default=None, metadata={"help": "Local HF model folder of the drafter."})
    random_models: bool = field(
        default=False,
        metadata={
            "help": "Use a small random Llama pair (no weights needed): checks the machinery, not quality."
        },
    )
    demo_models: bool = field(
        default=False,
        metadata={
            "help": "Use the bundled demo target and BudgetDraft drafter; without --prompt/--prompt_file the "
            "prompt is the start of the bundled held-out play (Shakespeare's King John)."
        },
    )
    prompt: str | None = field(
        default=None, metadata={"help": "Prompt text (needs a tokenizer in --target)."}
    )
    prompt_file: str | None = field(default=None, metadata={"help": "Read the prompt from this text file."})
    context_length: int = field(
        default=4096, metadata={"help": "Prompt tokens (random prompt, or truncate to)."}
    )
    cache: str = field(
        default="sink_window", metadata={"help": "Draft cache: sink_window | budgeted | full."}
    )
    num_sink_tokens: int = field(default=64, metadata={"help": "sink_window: attention-sink tokens."})
    window_length: int = field(default=1024, metadata={"help": "sink_window: recent-window tokens."})
    budgeted_window_length: int = field(
        default=256,
        metadata={"help": "budgeted: recent tokens kept besides the budget (the bench's demo/full default)."},
    )
    budget: int = field(default=512, metadata={"help": "budgeted: prefix tokens kept per layer and KV head."})
    policy: str = field(default="chunk", metadata={"help": "budgeted: chunk | streaming | snapkv."})
    gamma: int = field(default=5, metadata={"help": "Draft tokens per round (num_assistant_tokens)."})
    assistant_confidence_threshold: float = field(
        default=0.0,
        metadata={
            "help": "End a round's draft at the first token the drafter gives less than this probability (γ is "
            "then the most a round drafts); 0: always γ tokens."
        },
    )
    compiled_draft: bool = field(
        default=False,
        metadata={
            "help": "sink_window/budgeted: a static draft cache with the drafter's one-token step torch.compile'd; "
            "one untimed warm-up run compiles it first (tens of seconds on CPU)."
        },
    )
    target_attn_implementation: Literal["sdpa", "eager", "budgetdraft_sdpa"] = field(
        default="budgetdraft_sdpa",
        metadata={
            "help": "Target attention for AR and speculative runs alike: budgetdraft_sdpa (default: same results as "
            "sdpa, cheap verification on CPU) or stock sdpa/eager."
        },
    )
    max_new_tokens: int = field(default=64, metadata={"help": "Tokens to generate."})
    threads: int = field(default=2, metadata={"help": "torch threads (set explicitly; see README)."})
    seed: int = field(default=0, metadata={"help": "Seed for random models and prompts."})

    def __post_init__(self):
        if self.cache not in ("sink_window", "budgeted", "full"):
            raise ValueError(f"--cache must be sink_window, budgeted or full, got {self.cache!r}")
        if not 1 <= self.context_length <= MAX_CACHE_TOKENS:
            raise ValueError(
                f"--context_length must be in [1, {MAX_CACHE_TOKENS}], got {self.context_length}"
            )
        if not 1 <= self.max_new_tokens <= 4096:
            raise ValueError(f"--max_new_tokens must be in [1, 4096], got {self.max_new_tokens}")
        if not 1 <= self.gamma <= 64:
            raise ValueError(f"--gamma must be in [1, 64], got {self.gamma}")
        if not 0.0 <= self.assistant_confidence_threshold < 1.0:
            raise ValueError(
                f"--assistant_confidence_threshold must be in [0, 1), got {self.assistant_confidence_threshold}"
            )
        if self.compiled_draft and self.cache == "full":
            raise ValueError(
                "--compiled_draft compiles the step of a static sparse draft cache; use --cache sink_window or "
                "budgeted, or drop --compiled_draft"
            )
        if self.random_models + self.demo_models + bool(self.target and self.drafter) != 1:
            raise ValueError("pass one of --demo_models, --random_models, or both --target and --drafter")


def _load_pair(args: GenerateArguments):
    def load(path):
        return AutoModelForCausalLM.from_pretrained(path, use_safetensors=True, local_files_only=True).eval()

    tokenizer = AutoTokenizer.from_pretrained(args.target, local_files_only=True)
    return load(args.target), load(args.drafter), tokenizer


def _prompt_ids(args: GenerateArguments, tokenizer, vocab_size: int) -> torch.LongTensor:
    text = args.prompt
    if args.prompt_file:
        with open(args.prompt_file, encoding="utf-8") as handle:
            text = handle.read()
    if text is None and args.demo_models:
        text = DEMO_TEXT.read_text(encoding="utf-8")
    if text is None:
        generator = torch.Generator().manual_seed(args.seed)
        return torch.randint(0, vocab_size, (1, args.context_length), generator=generator)
    if tokenizer is None:
        raise ValueError("a text prompt needs a tokenizer: use --target/--drafter model folders")
    return tokenizer(text, return_tensors="pt").input_ids[:, -args.context_length :]


def generate_command(args: GenerateArguments) -> int:
    torch.set_num_threads(args.threads)
    if args.random_models:
        target, drafter = random_pair(args.seed, args.context_length + args.max_new_tokens + 1)
        tokenizer = None
    elif args.demo_models:
        from .demo import load_demo_models

        demo = load_demo_models()
        target, drafter, tokenizer = demo.target, demo.drafter, demo.tokenizer
    else:
        target, drafter, tokenizer = _load_pair(args)
    target.set_attn_implementation(args.target_attn_implementation)
    ids = _prompt_ids(args, tokenizer, target.config.vocab_size)
    cache_config = None
    if args.cache == "sink_window":
        cache_config = {"num_sink_tokens": args.num_sink_tokens, "window_length": args.window_length}
    elif args.cache == "budgeted":
        cache_config = {
            "budget": args.budget,
            "policy": args.policy,
            "window_length": args.budgeted_window_length,
        }
    if args.compiled_draft:  # validated: a sparse cache
        cache_config["static"] = True
        drafter.set_attn_implementation(VARLEN_NAME)  # what hides a static cache's empty slots
    cache = None if args.cache == "full" else args.cache
    draft = dict(
        gamma=args.gamma,
        cache_implementation=cache,
        cache_config=cache_config,
        compiled=args.compiled_draft,
        confidence_threshold=args.assistant_confidence_threshold,
    )
    if args.compiled_draft:
        print("compiling the draft step (one untimed warm-up run)", flush=True)
        run_assisted(target, drafter, ids, min(args.max_new_tokens, 2 * args.gamma), **draft)
    # the benchmark's runners: greedy, exactly max_new_tokens, decode time read off a streamer
    ar = run_ar(target, ids, args.max_new_tokens)
    spec = run_assisted(target, drafter, ids, args.max_new_tokens, **draft)

    new, stats = spec.new_ids, spec.stats
    diff = int((new != ar.new_ids).sum())
    print(
        f"prompt tokens: {ids.shape[1]}  new tokens: {new.numel()}  draft cache: {args.cache}"
        f"{' (static, compiled step)' if args.compiled_draft else ''}"
    )
    print(tokenizer.decode(new) if tokenizer is not None else f"token ids: {new.tolist()}")
    print(
        f"greedy diff vs the target's own greedy output: {diff} tokens ({'identical' if diff == 0 else 'DIFFERENT'})"
    )
    print(
        f"rounds {stats.rounds}, mean accepted length {stats.mean_accepted_length:.2f}, acceptance rate "
        f"{stats.acceptance_rate:.1%}, draft {stats.draft_seconds:.2f} s, verify {stats.verify_seconds:.2f} s"
    )
    decode = ar.decode_tokens_per_second, spec.decode_tokens_per_second
    decode_text = (
        f"; decode (after the prefill) {decode[0]:.1f} vs {decode[1]:.1f} tok/s, {decode[1] / decode[0]:.2f}x"
        if all(decode)
        else ""
    )
    print(
        f"plain AR {ar.seconds:.2f} s, speculative {spec.seconds:.2f} s, end to end {ar.seconds / spec.seconds:.2f}x"
        f"{decode_text} (one run, {args.threads} threads; use benchmarks/ for measured ratios)"
    )
    return 0 if diff == 0 else 1


@dataclass
class TrainScriptArguments:
    """What `hf-budgetdraft train` loads; the method and the optimisation are `BudgetDraftConfig`'s flags."""

    drafter: str | None = field(
        default=None,
        metadata={"help": "The drafter to train: a local HF folder or hub name (loaded in fp32)."},
    )
    data_files: list[str] | None = field(
        default=None,
        metadata={"help": "Local .txt/.md files (one document each), .json/.jsonl, or folders holding them."},
    )
    dataset_name: str | None = field(
        default=None,
        metadata={"help": "A `datasets` name instead of --data_files (needs network), e.g. emozilla/pg19."},
    )
    dataset_config_name: str | None = field(
        default=None, metadata={"help": "Configuration of --dataset_name."}
    )
    dataset_split: str = field(default="train", metadata={"help": "Split of --dataset_name."})
    text_column: str = field(default="text", metadata={"help": "Column holding the text."})
    tokenizer: str | None = field(
        default=None, metadata={"help": "Tokenizer folder/name (defaults to the teacher's)."}
    )
    pack_across_documents: bool = field(
        default=True,
        metadata={"help": "Concatenate documents before cutting rows (False: one document per row)."},
    )
    max_train_rows: int | None = field(
        default=None, metadata={"help": "Use at most this many packed rows (a seeded random sample)."}
    )
    continuations: str = field(
        default="text",
        metadata={
            "help": "Each row's continuation: 'text' (as cut from the data) or 'target' (the target's own greedy "
            "continuation of the row's prefix, generated once and cached: the text the drafter drafts at "
            "inference)."
        },
    )
    precompute_teacher: bool = field(
        default=False,
        metadata={
            "help": "Run the teacher once over the data with datasets.map and cache its targets on disk."
        },
    )
    teacher_top_k: int = field(
        default=0,
        metadata={"help": "With --precompute_teacher: also store top-k log-probs (needed by --loss soft)."},
    )
    teacher_cache_dir: str | None = field(
        default=None,
        metadata={
            "help": "Where precomputed targets and continuations are cached (default: OUTPUT_DIR/teacher_targets)."
        },
    )
    random_models: bool = field(
        default=False,
        metadata={
            "help": "Smoke run: a small random Llama pair and random token rows (checks the machinery only)."
        },
    )
    num_random_rows: int = field(default=64, metadata={"help": "--random_models: rows of random tokens."})
    threads: int | None = field(default=None, metadata={"help": "torch threads (default: torch's choice)."})

    def __post_init__(self):
        sources = sum(x is not None for x in (self.data_files, self.dataset_name)) + self.random_models
        if sources != 1:
            raise ValueError("pass exactly one data source: --data_files, --dataset_name or --random_models")
        if not self.random_models and self.drafter is None:
            raise ValueError(
                "pass --drafter (the model to train) and --teacher_model_name_or_path (the target)"
            )
        if self.teacher_top_k < 0:
            raise ValueError(f"--teacher_top_k must be >= 0, got {self.teacher_top_k}")
        if self.continuations not in ("text", "target"):
            raise ValueError(f"--continuations must be 'text' or 'target', got {self.continuations!r}")


def _train_data(script: TrainScriptArguments, config, target, tokenizer):
    import datasets

    from .trainer import load_text_dataset, pack_dataset

    if script.random_models:
        generator = torch.Generator().manual_seed(config.seed)
        rows = torch.randint(
            0, target.config.vocab_size, (script.num_random_rows, config.sequence_length), generator=generator
        )
        return datasets.Dataset.from_dict({"input_ids": rows.tolist()})
    documents = load_text_dataset(
        data_files=script.data_files,
        dataset_name=script.dataset_name,
        dataset_config_name=script.dataset_config_name,
        split=script.dataset_split,
        text_column=script.text_column,
    )
    return pack_dataset(
        documents,
        tokenizer,
        config.sequence_length,
        text_column=script.text_column,
        across_documents=script.pack_across_documents,
    )


def _optional_tokenizer(path: str):
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        return None


def train_command(script: TrainScriptArguments, config) -> int:
    from transformers.trainer_utils import get_last_checkpoint

    from .trainer import BudgetDraftTrainer, generate_target_continuations, precompute_teacher_targets

    if script.threads:
        torch.set_num_threads(script.threads)
    if script.random_models:
        target, drafter = random_pair(config.seed, config.sequence_length + 1)
        tokenizer = teacher_tokenizer = None
    else:
        if config.teacher_model_name_or_path is None:
            raise ValueError(
                "pass --teacher_model_name_or_path (the frozen target whose tokens the drafter learns)"
            )
        target = AutoModelForCausalLM.from_pretrained(
            config.teacher_model_name_or_path, dtype=config.teacher_dtype
        )
        drafter = AutoModelForCausalLM.from_pretrained(script.drafter, dtype=torch.float32)
        teacher_tokenizer = AutoTokenizer.from_pretrained(
            script.tokenizer or config.teacher_model_name_or_path
        )
        tokenizer = _optional_tokenizer(script.drafter) or teacher_tokenizer
    dataset = _train_data(script, config, target, teacher_tokenizer)
    if script.max_train_rows is not None and script.max_train_rows < len(dataset):
        # a seeded sample, not the first documents' rows: the subset keeps the corpus' mix of sources
        dataset = dataset.shuffle(seed=config.seed).select(range(script.max_train_rows))
    print(f"{len(dataset)} training rows of {config.prefix_length} + {config.continuation_length} tokens")
    cache_dir = script.teacher_cache_dir or f"{config.output_dir}/teacher_targets"
    if script.continuations == "target":
        dataset = generate_target_continuations(
            dataset,
            target.to(config.device),
            config.prefix_length,
            config.continuation_length,
            cache_dir=cache_dir,
        )
    if script.precompute_teacher:
        target.to(config.device)
        dataset = precompute_teacher_targets(
            dataset,
            target,
            config.prefix_length,
            config.continuation_length,
            top_k=script.teacher_top_k,
            temperature=config.temperature,
            cache_dir=cache_dir,
        )
    trainer = BudgetDraftTrainer(
        model=drafter,
        teacher=target,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        teacher_processing_class=teacher_tokenizer,
    )
    resume = config.resume_from_checkpoint
    if resume in ("last", "latest"):
        resume = get_last_checkpoint(config.output_dir)
    trainer.train(resume_from_checkpoint=resume)
    paths = trainer.save_drafter()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    if logged:
        first, last = logged[0], logged[-1]
        print(f"loss {first['loss']:.4f} (step {first['step']}) -> {last['loss']:.4f} (step {last['step']})")
        for key in sorted(k for k in last if k.startswith("agreement/")):
            start = f"{first[key]:.3f}" if key in first else "n/a"
            print(f"  {key}: {start} -> {last[key]:.3f}")
    print(
        f"drafter saved to {paths['model']} (AutoModelForCausalLM)"
        + (f", LoRA adapter to {paths['adapter']}" if "adapter" in paths else "")
    )
    budget = config.budgets[0]
    print(
        f"use it: target.generate(ids, assistant_model=drafter, cache_implementation={config.cache_kind!r}, "
        f"cache_config={config.cache_config(budget)})"
    )
    return 0


COMMANDS = {
    "generate": (GenerateArguments, generate_command),
    "train": ((TrainScriptArguments, BudgetDraftConfig), train_command),
    "bench": (BenchArguments, bench_command),
    "demo": (AppArguments, demo_command),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(
            f"usage: hf-budgetdraft {{{','.join(COMMANDS)}}} [--help] [options]\n\n{__doc__}", file=sys.stderr
        )
        return 2
    arguments_classes, run = COMMANDS[argv[0]]
    parser = HfArgumentParser(arguments_classes, prog=f"hf-budgetdraft {argv[0]}")
    try:
        args = parser.parse_args_into_dataclasses(args=argv[1:])
    except ValueError as error:
        parser.error(str(error))
    return run(*args)


if __name__ == "__main__":
    sys.exit(main())
