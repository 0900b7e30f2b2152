"""`hf-budgetdraft` command line. Sub-commands: `generate` (speculative generation with a sparse draft cache,
checked token-for-token against the target's own greedy output); `train` (BudgetDraft training of a drafter
against a frozen target, see `hf_budgetdraft.trainer`); `bench` (every decoding method on long-context tasks:
greedy-diff losslessness, acceptance, speed-up, phase costs, memory; see `hf_budgetdraft.eval`); `demo` (the Gradio
app on 127.0.0.1, see `hf_budgetdraft.app`); `export` (a drafter as a sliding-window HF checkpoint plus the vLLM /
SGLang command line that serves it, see `hf_budgetdraft.export_drafter`)."""

from __future__ import annotations

import sys

from transformers import HfArgumentParser

from .app.arguments import AppArguments
from .commands import (
    ExportArguments,
    GenerateArguments,
    TrainScriptArguments,
    bench_command,
    demo_command,
    export_command,
    generate_command,
    train_command,
)
from .eval.bench_args import BenchArguments
from .trainer.config import BudgetDraftConfig

# sub-command -> (the dataclasses its flags fill, the function they are passed to; it returns the exit code)
COMMANDS = {
    "generate": (GenerateArguments, generate_command),
    "train": ((TrainScriptArguments, BudgetDraftConfig), train_command),
    "bench": (BenchArguments, bench_command),
    "demo": (AppArguments, demo_command),
    "export": (ExportArguments, export_command),
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
    try:
        return run(*args)
    # bad input found while running (a model, a prompt): its words, no traceback
    except (ValueError, OSError) as error:
        print(f"hf-budgetdraft {argv[0]}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
