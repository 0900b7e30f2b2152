"""`hf-budgetdraft train`: BudgetDraft training of a drafter against a frozen target (`hf_budgetdraft.trainer`).

`TrainScriptArguments` says what to load (the drafter, the data, the teacher's precomputed targets); the method and
the optimisation are `BudgetDraftConfig`'s flags (a `transformers.TrainingArguments`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..demo.random_models import random_pair
from ..loading import LoadFlags, load_model, load_tokenizer, revision_field, trust_remote_code_field
from ..trainer.config import BudgetDraftConfig


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
            "help": "Each row's continuation: 'text' (as cut from the data) or 'target' (the target's own "
            "continuation of the row's prefix, generated once and cached: the text the drafter drafts at "
            "inference; greedy, or sampled for --sampled_continuations of the rows)."
        },
    )
    sampled_continuations: float = field(
        default=0.0,
        metadata={
            "help": "--continuations target: share of the rows the target continues by sampling at --temperature "
            "(the text a sampling call drafts) instead of greedily; 0.5 with --loss hard+soft trains one drafter "
            "for both kinds of call."
        },
    )
    continuation_batch_size: int = field(
        default=8,
        metadata={
            "help": "--continuations target: rows the target continues at once (equal-length prefixes)."
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
    revision: str | None = revision_field()
    trust_remote_code: bool = trust_remote_code_field()
    attn_implementation: str = field(
        default="sdpa", metadata={"help": "The attention the teacher and the drafter are loaded with."}
    )

    def load_flags(self, dtype: str) -> LoadFlags:
        """How the drafter (float32) and the teacher (`--teacher_dtype`) load; the Trainer places them."""
        return LoadFlags(
            dtype=dtype,
            attn_implementation=self.attn_implementation,
            revision=self.revision,
            trust_remote_code=self.trust_remote_code,
        )

    def __post_init__(self):
        sources = sum(x is not None for x in (self.data_files, self.dataset_name)) + self.random_models
        if sources != 1:
            raise ValueError("pass exactly one data source: --data_files, --dataset_name or --random_models")
        if not self.random_models and self.drafter is None:
            raise ValueError(
                "pass --drafter (the model to train) and --teacher_model_name_or_path (the target)"
            )
        self.load_flags("float32")  # refuses a bad --attn_implementation before anything loads
        if self.teacher_top_k < 0:
            raise ValueError(f"--teacher_top_k must be >= 0, got {self.teacher_top_k}")
        if self.continuations not in ("text", "target"):
            raise ValueError(f"--continuations must be 'text' or 'target', got {self.continuations!r}")
        if not 1 <= self.continuation_batch_size <= 4096:
            raise ValueError(
                f"--continuation_batch_size must be in [1, 4096], got {self.continuation_batch_size}"
            )
        if not 0.0 <= self.sampled_continuations <= 1.0:
            raise ValueError(f"--sampled_continuations must be in [0, 1], got {self.sampled_continuations}")
        if self.sampled_continuations and self.continuations != "target":
            raise ValueError(
                "--sampled_continuations needs --continuations target (it sets how they are generated)"
            )


def _train_data(script: TrainScriptArguments, config, target, tokenizer):
    import datasets

    from ..trainer import load_text_dataset, pack_dataset

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


def _optional_tokenizer(name: str, flags: LoadFlags):
    try:
        return load_tokenizer(name, flags)
    except (OSError, ValueError):
        return None


def train_command(script: TrainScriptArguments, config: BudgetDraftConfig) -> int:
    from transformers.trainer_utils import get_last_checkpoint

    from ..trainer import BudgetDraftTrainer

    if script.threads:
        torch.set_num_threads(script.threads)
    target, drafter, tokenizer, teacher_tokenizer = _train_models(script, config)
    dataset = _teacher_targets(script, config, target, _train_rows(script, config, target, teacher_tokenizer))
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
    _report_training(trainer, config)
    return 0


def _train_models(script: TrainScriptArguments, config: BudgetDraftConfig):
    """`(target, drafter, drafter tokenizer, teacher tokenizer)`; the tokenizers are `None` for random models."""
    if script.random_models:
        target, drafter = random_pair(config.seed, config.sequence_length + 1)
        return target, drafter, None, None
    if config.teacher_model_name_or_path is None:
        raise ValueError(
            "pass --teacher_model_name_or_path (the frozen target whose tokens the drafter learns)"
        )
    teacher_flags = script.load_flags(config.teacher_dtype)
    target = load_model(config.teacher_model_name_or_path, teacher_flags)
    drafter = load_model(script.drafter, script.load_flags("float32"))
    teacher_tokenizer = load_tokenizer(script.tokenizer or config.teacher_model_name_or_path, teacher_flags)
    drafter_tokenizer = _optional_tokenizer(script.drafter, teacher_flags) or teacher_tokenizer
    return target, drafter, drafter_tokenizer, teacher_tokenizer


def _train_rows(script: TrainScriptArguments, config: BudgetDraftConfig, target, tokenizer):
    """The packed training rows, a seeded sample of them with `--max_train_rows`."""
    dataset = _train_data(script, config, target, tokenizer)
    if script.max_train_rows is not None and script.max_train_rows < len(dataset):
        # a seeded sample, not the first documents' rows: the subset keeps the corpus' mix of sources
        dataset = dataset.shuffle(seed=config.seed).select(range(script.max_train_rows))
    print(f"{len(dataset)} training rows of {config.prefix_length} + {config.continuation_length} tokens")
    return dataset


def _teacher_targets(script: TrainScriptArguments, config: BudgetDraftConfig, target, dataset):
    """The rows with the target's own continuations (`--continuations target`) and its precomputed targets
    (`--precompute_teacher`), each generated once and cached on disk."""
    from ..trainer import generate_target_continuations, precompute_teacher_targets

    cache_dir = script.teacher_cache_dir or f"{config.output_dir}/teacher_targets"
    if script.continuations == "target":
        dataset = generate_target_continuations(
            dataset,
            target.to(config.device),
            config.prefix_length,
            config.continuation_length,
            batch_size=script.continuation_batch_size,
            cache_dir=cache_dir,
            sampled_fraction=script.sampled_continuations,
            temperature=config.temperature,
            seed=config.seed,
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
    return dataset


def _report_training(trainer, config: BudgetDraftConfig) -> None:
    """Save the drafter and print the loss and agreement curves' ends and how to use it."""
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
