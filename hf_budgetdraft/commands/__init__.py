"""The sub-commands of `hf-budgetdraft`, one module each: its flags (an `*Arguments` dataclass, or the library's
own where the library runs on it) and its `*_command` function, which returns the exit code. `hf_budgetdraft.cli`
only parses the flags and dispatches.

- `generate`: speculative generation with a sparse draft cache, checked against the target's greedy output;
- `train`: BudgetDraft training of a drafter against a frozen target;
- `bench`: every decoding method on long-context tasks;
- `demo`: the Gradio app on 127.0.0.1;
- `export`: a drafter as a sliding-window HF checkpoint for vLLM / SGLang, with the command that serves it.
"""

from .bench import bench_command
from .demo import demo_command
from .export import ExportArguments, export_command
from .generate import GenerateArguments, generate_command
from .train import TrainScriptArguments, train_command

__all__ = [
    "ExportArguments",
    "GenerateArguments",
    "TrainScriptArguments",
    "bench_command",
    "demo_command",
    "export_command",
    "generate_command",
    "train_command",
]
