"""`hf-budgetdraft export --for vllm|sglang`: a drafter (the bundled BudgetDraft one by default) as a
sliding-window HF checkpoint a serving engine loads as its draft model, and the engine's command line
(`hf_budgetdraft.export_drafter.export_drafter`)."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ..export_drafter import DEFAULT_WINDOW, DTYPES, MARKER, check_options, check_output_dir, export_drafter
from ..loading import LoadFlags, load_model, load_tokenizer, revision_field, trust_remote_code_field


@dataclass
class ExportArguments:
    """What `hf-budgetdraft export` writes; with no `--drafter` it exports the bundled BudgetDraft drafter."""

    engine: Literal["vllm", "sglang"] = field(
        metadata={"aliases": ["--for"], "help": "The serving engine the snippet is for: vllm | sglang."}
    )
    output_dir: str = field(metadata={"help": "Folder to write the checkpoint into (new or empty)."})
    drafter: str | None = field(
        default=None,
        metadata={
            "help": "A Llama-architecture drafter: a local folder or a hub id in the Hugging Face cache (default: "
            "the bundled one)."
        },
    )
    tokenizer: str | None = field(
        default=None,
        metadata={
            "help": "Tokenizer (folder or hub id) to copy (default: the drafter's own, if it has one)."
        },
    )
    target: str | None = field(
        default=None,
        metadata={
            "help": "Target model written into the command line (default: the bundled target's folder)."
        },
    )
    window_length: int = field(
        default=DEFAULT_WINDOW,
        metadata={"help": "Past tokens each draft step reads (sink_window's W); the config says W + 1."},
    )
    num_sink_tokens: int = field(
        default=0,
        metadata={"help": "sglang only: sink tokens its draft-decode steps keep (vLLM's window has none)."},
    )
    num_speculative_tokens: int = field(default=6, metadata={"help": "Tokens the engine drafts a round."})
    dtype: Literal["float32", "bfloat16", "float16"] = field(
        default="float32", metadata={"help": "Weights' dtype on disk (float32 keeps merged weights exact)."}
    )
    overwrite: bool = field(
        default=False, metadata={"help": "Replace OUTPUT_DIR if it holds an earlier export."}
    )
    revision: str | None = revision_field()
    trust_remote_code: bool = trust_remote_code_field()

    def __post_init__(self):
        check_options(self.engine, self.window_length, self.num_sink_tokens, self.num_speculative_tokens)
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")


def _load(args: ExportArguments):
    """`(drafter, tokenizer or None, target for the command line)` the arguments name."""
    if args.drafter is None:
        from ..demo import load_demo_models
        from ..demo.models import DEMO_DIR

        demo = load_demo_models()
        tokenizer = load_tokenizer(args.tokenizer, LoadFlags()) if args.tokenizer else demo.tokenizer
        return demo.drafter, tokenizer, args.target or str(DEMO_DIR / "target")
    folder = Path(args.drafter)
    if (folder / "adapter_config.json").is_file() and not (folder / "config.json").is_file():
        raise ValueError(
            f"{args.drafter!r} is a PEFT adapter; export the merged model (`hf-budgetdraft train` saves one beside "
            "the adapter, or merge it with `merge_and_unload()` and save_pretrained)"
        )
    # float32 on the CPU: the weights are written in --dtype afterwards
    flags = LoadFlags(dtype="float32", revision=args.revision, trust_remote_code=args.trust_remote_code)
    drafter = load_model(args.drafter, flags)
    return drafter, _optional_tokenizer(args.tokenizer or args.drafter, flags), args.target or "TARGET_MODEL"


def _optional_tokenizer(name: str, flags: LoadFlags):
    try:
        return load_tokenizer(name, flags)
    except (OSError, ValueError):
        return None


def export_command(args: ExportArguments) -> int:
    """`hf-budgetdraft export`: write the checkpoint and print how to serve it."""
    try:
        check_output_dir(
            Path(args.output_dir).expanduser().resolve(), args.overwrite
        )  # before loading anything
        drafter, tokenizer, target = _load(args)
        path = export_drafter(
            drafter,
            args.output_dir,
            engine=args.engine,
            window_length=args.window_length,
            num_sink_tokens=args.num_sink_tokens,
            num_speculative_tokens=args.num_speculative_tokens,
            tokenizer=tokenizer,
            target=target,
            dtype=DTYPES[args.dtype],
            overwrite=args.overwrite,
        )
    except (FileExistsError, ValueError) as error:
        print(f"hf-budgetdraft export: error: {error}", file=sys.stderr)
        return 2
    record = json.loads((path / MARKER).read_text(encoding="utf-8"))
    print(f"wrote {path} (MistralForCausalLM, sliding_window={record['sliding_window']} on every layer)")
    if tokenizer is None:
        print("no tokenizer found for the drafter: none written (the engines use the target's)")
    print(f"serve it with {args.engine}:\n  {record['command']}")
    return 0
