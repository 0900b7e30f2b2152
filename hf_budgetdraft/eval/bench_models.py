"""The models and documents one bench compares, per preset (`BenchModels`, `load_models`, `load_corpus`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..attention.varlen import NAME as VARLEN_NAME
from ..demo.corpus import Document, load_documents, load_hub_documents, stdlib_documents
from ..loading import DTYPES, LoadFlags, drafter_tokenizer, load_model, load_tokenizer
from .bench_args import MAX_GAMMA, BenchArguments

TOKENIZER_DIR = Path(__file__).resolve().parent.parent / "demo" / "tokenizer"


@dataclass
class BenchModels:
    """The models one bench compares: targets by name (`"target"`, `"mtp"`), drafters by name, and the tokenizers
    of the drafters that bring their own (by drafter name: their calls translate between the two tokenizers)."""

    tokenizer: Any
    targets: dict[str, Any]
    drafters: dict[str, Any]
    description: dict[str, str] = field(default_factory=dict)
    drafter_tokenizers: dict[str, Any] = field(default_factory=dict)


def bundled_tokenizer():
    """The demo tokenizer shipped in the package (the smoke preset's)."""
    from transformers import AutoTokenizer

    if not (TOKENIZER_DIR / "tokenizer.json").exists():
        raise FileNotFoundError(
            f"the bundled tokenizer is missing from {TOKENIZER_DIR}; reinstall hf-budgetdraft"
        )
    return AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))


def smoke_models(args: BenchArguments, mtp_dir: str | None) -> BenchModels:
    """The smoke preset's tiny pair (+ a tiny MTP model saved under `mtp_dir` when MTP is benchmarked)."""
    from ..demo.random_models import smoke_mtp_model, smoke_pair

    positions = max(args.contexts) + args.new_tokens + MAX_GAMMA + 8
    target, drafter = smoke_pair(seed=args.seed, max_position_embeddings=positions)
    targets = {"target": target}
    description = {
        "target": "smoke_pair target (random Llama, 2 layers, hidden 64)",
        "drafter": "target + 1% noise",
    }
    if "mtp" in args.methods and mtp_dir is not None:
        targets["mtp"] = smoke_mtp_model(mtp_dir, seed=args.seed, max_position_embeddings=positions)
        description["mtp"] = "smoke_mtp_model (random GLM-4-style, 2 dense layers + 2 random MTP layers)"
    return BenchModels(bundled_tokenizer(), targets, {"drafter": drafter}, description)


def demo_models(do_sample: bool = False) -> BenchModels:
    """The bundled demo models (`hf_budgetdraft.demo.load_demo_models`); `drafter` is the one trained for the
    bench's kind of call (the sampling drafter with `do_sample`)."""
    from ..demo import load_demo_models

    demo = load_demo_models()
    kind = "sampling" if do_sample else "greedy"
    return BenchModels(
        demo.tokenizer,
        {"target": demo.target, "mtp": demo.target},  # the target's own trained MTP layer drafts for `mtp`
        {"base_drafter": demo.base_drafter, "drafter": demo.drafter_for(do_sample)},
        {
            "target": "bundled demo target (GLM-4-style, 7 dense layers, 9.9M)",
            "mtp": "the bundled target with its trained MTP layer",
            "drafter": f"bundled BudgetDraft drafter for {kind} calls (base drafter + BudgetDraft LoRA)",
            "base_drafter": "bundled base drafter (Llama, distilled on a full cache)",
        },
    )


def full_models(args: BenchArguments) -> BenchModels:
    """Your models, each a local folder or a hub id, through the package's one loader."""
    from ..generation.mtp_heads import expose_mtp_layers

    flags = load_flags(args)
    tokenizer = load_tokenizer(args.tokenizer or args.target, flags)
    targets = {"target": load_model(args.target, flags)}
    names = {"drafter": args.drafter} | ({"base_drafter": args.base_drafter} if args.base_drafter else {})
    drafters = {name: load_model(path, flags) for name, path in names.items()}
    own = {
        name: drafter_tokenizer(path, flags, targets["target"], drafters[name], tokenizer)
        for name, path in names.items()
    }
    description = {"target": args.target} | names
    if "mtp" in args.methods and args.mtp_model:
        targets["mtp"] = expose_mtp_layers(load_model(args.mtp_model, flags))
        description["mtp"] = args.mtp_model
    translated = {name: tok for name, tok in own.items() if tok is not None}
    return BenchModels(tokenizer, targets, drafters, description, translated)


def load_flags(args: BenchArguments) -> LoadFlags:
    return LoadFlags(
        device=args.device, dtype=args.dtype, revision=args.revision, trust_remote_code=args.trust_remote_code
    )


def load_models(args: BenchArguments, mtp_dir: str | None) -> BenchModels:
    if args.preset == "smoke":
        models = smoke_models(args, mtp_dir)
    elif args.preset == "demo":
        models = demo_models(args.do_sample)
        if args.mtp_model:
            from ..generation.mtp_heads import expose_mtp_layers

            models.targets["mtp"] = expose_mtp_layers(load_model(args.mtp_model, load_flags(args)))
    else:
        models = full_models(args)
    for model in (*models.targets.values(), *models.drafters.values()):
        model.to(device=args.device, dtype=DTYPES[args.dtype])
    if args.target_attn_implementation is not None:
        for model in models.targets.values():
            model.set_attn_implementation(args.target_attn_implementation)
    if args.compiled_draft:
        for model in models.drafters.values():
            model.set_attn_implementation(VARLEN_NAME)
        # one graph per static-cache shape (budget) and drafter: room for the whole grid before dynamo gives up
        torch._dynamo.config.recompile_limit = max(
            torch._dynamo.config.recompile_limit, 4 * len(args.budgets) * len(models.drafters)
        )
    return models


def load_corpus(args: BenchArguments) -> tuple[list[Document], str]:
    """The documents of the `document`/`code` tasks and where they came from."""
    if args.data_files:
        return load_documents(args.data_files), f"files {args.data_files}"
    if args.dataset_name:
        documents = load_hub_documents(
            args.dataset_name,
            args.dataset_config_name,
            args.dataset_split,
            args.text_column,
            args.max_documents,
        )
        return documents, f"datasets {args.dataset_name} ({args.dataset_split})"
    if args.preset == "demo":
        from ..demo.documents import demo_documents

        return demo_documents()
    if args.preset == "full":
        if not args.tasks_from_preset and any(t in ("document", "code") for t in args.tasks):
            raise ValueError(
                "--preset full with the document/code tasks needs --data_files or --dataset_name"
            )
        return [], "none (no --data_files/--dataset_name: passkey tasks only)"
    return stdlib_documents(), "Python standard library (pydoc topics + stdlib sources), offline"
