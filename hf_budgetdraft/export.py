"""`hf-budgetdraft export --for vllm|sglang`: a trained drafter as a plain HF checkpoint a serving engine loads as
its draft model, with the window the draft reads declared in its config, plus the engine's command line.

A Llama-architecture drafter is written as `MistralForCausalLM`: the same layers and weight names (Mistral is Llama
without biases, plus a `sliding_window`), with `layer_types = ["sliding_attention"] * num_layers`. transformers loads a
Mistral config that has `layer_types` as Ministral (a per-layer window), so `AutoModelForCausalLM` runs every layer
windowed; vLLM's Llama/Mistral attention takes its per-layer window from `layer_types` + `sliding_window`. SGLang's
Llama/Mistral models ignore the config's window; its draft-window flags (written in the snippet) apply one instead.

Window semantics. `window_length` W is what `SinkWindowCache(num_sink_tokens=0, window_length=W)` reads: the W
most recent past tokens, besides the query itself. transformers' (and the engines') `sliding_window` counts the
query too, so the config declares `sliding_window = W + 1`. Where they differ from the package's `sink_window`:
no sink (vLLM), and the window applies inside a multi-token forward (the drafter's prefill) as well, where a
`SinkWindowCache` lets a forward's own tokens see each other. One token a forward, the two agree exactly.
"""

from __future__ import annotations

import copy
import json
import os
import shlex
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
)

from .cache.base import check_size
from .generation.spec import MAX_DRAFT_LENGTH, DraftSpec

ENGINES = ("vllm", "sglang")
MARKER = "serving.json"  # written by every export; `overwrite` only replaces a folder that holds it
DEFAULT_WINDOW = DraftSpec(cache="sink_window").window_length
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Llama-architecture drafters whose weights a Mistral model holds unchanged (no attention/MLP bias, silu MLP)
_FAMILIES = ("llama", "mistral", "ministral")
_MISTRAL_FIELDS = set(MistralConfig.__dataclass_fields__)


@dataclass
class ExportArguments:
    """What `hf-budgetdraft export` writes; with no `--drafter` it exports the bundled BudgetDraft drafter."""

    engine: Literal["vllm", "sglang"] = field(
        metadata={"aliases": ["--for"], "help": "The serving engine the snippet is for: vllm | sglang."}
    )
    output_dir: str = field(metadata={"help": "Folder to write the checkpoint into (new or empty)."})
    drafter: str | None = field(
        default=None,
        metadata={"help": "Local HF folder of a Llama-architecture drafter (default: the bundled one)."},
    )
    tokenizer: str | None = field(
        default=None,
        metadata={"help": "Tokenizer folder to copy (default: the drafter's own, if it has one)."},
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

    def __post_init__(self):
        check_options(self.engine, self.window_length, self.num_sink_tokens, self.num_speculative_tokens)
        if self.dtype not in _DTYPES:
            raise ValueError(f"--dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")


def check_options(engine: str, window_length: int, num_sink_tokens: int, num_speculative_tokens: int) -> None:
    """Raise `ValueError`/`TypeError` naming the option unless the engine can serve this window and draft length."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    check_size("window_length", window_length, 1)
    check_size("num_sink_tokens", num_sink_tokens, 0)
    if not isinstance(num_speculative_tokens, int) or isinstance(num_speculative_tokens, bool):
        raise TypeError(f"num_speculative_tokens must be an int, got {num_speculative_tokens!r}")
    if not 1 <= num_speculative_tokens <= MAX_DRAFT_LENGTH:
        raise ValueError(
            f"num_speculative_tokens must be in [1, {MAX_DRAFT_LENGTH}], got {num_speculative_tokens}"
        )
    if engine == "vllm" and num_sink_tokens:
        raise ValueError(
            f"num_sink_tokens={num_sink_tokens}: vLLM's sliding window keeps no attention sink; pass "
            "num_sink_tokens=0, or export for sglang (its draft-decode window can keep a sink)"
        )


def sliding_window_config(config, window_length: int) -> MistralConfig:
    """The `MistralConfig` of a Llama-architecture `config` whose every layer reads `window_length` past tokens.

    Raises `ValueError` for a drafter whose weights a Mistral model cannot hold unchanged (another family,
    attention or MLP biases, tensor-parallel-split weights, another activation).
    """
    check_size("window_length", window_length, 1)
    text = config.get_text_config(decoder=True)
    problems = _unsupported(text)
    if problems:
        raise ValueError(
            f"cannot export a {text.model_type!r} drafter as a sliding-window checkpoint: {'; '.join(problems)}. "
            f"Supported: Llama-architecture drafters ({', '.join(_FAMILIES)}) without biases."
        )
    if window_length + 1 > text.max_position_embeddings:
        raise ValueError(
            f"window_length={window_length} + 1 exceeds the drafter's max_position_embeddings "
            f"({text.max_position_embeddings}): the window would never drop a token; pick a smaller window"
        )
    fields = {k: v for k, v in text.to_dict().items() if k in _MISTRAL_FIELDS}
    fields.pop("model_type", None)
    # `sliding_window` counts the query token, as transformers and the engines do
    config = MistralConfig(
        **{**fields, "architectures": ["MistralForCausalLM"], "sliding_window": window_length + 1}
    )
    # set after construction: MistralConfig warns about a `layer_types` argument
    config.layer_types = ["sliding_attention"] * text.num_hidden_layers
    return config


def _unsupported(config) -> list[str]:
    problems = []
    if config.model_type not in _FAMILIES:
        problems.append(f"model_type {config.model_type!r}")
    for name in ("attention_bias", "mlp_bias"):
        if getattr(config, name, False):
            problems.append(f"{name}=True")
    if getattr(config, "pretraining_tp", 1) != 1:
        problems.append(f"pretraining_tp={config.pretraining_tp}")
    if config.hidden_act != "silu":
        problems.append(f"hidden_act {config.hidden_act!r}")
    layer_types = getattr(config, "layer_types", None) or []
    if any(t not in ("full_attention", "sliding_attention") for t in layer_types):
        problems.append(f"layer_types {sorted(set(layer_types))}")
    return problems


def sliding_window_model(drafter: PreTrainedModel, window_length: int) -> MistralForCausalLM:
    """`drafter`'s weights, unchanged, in a `MistralForCausalLM` whose layers all read `window_length` past tokens."""
    config = sliding_window_config(drafter.config, window_length)
    config.dtype = drafter.dtype
    model = MistralForCausalLM(config).to(drafter.dtype)
    model.load_state_dict(drafter.state_dict(), strict=True)
    model.generation_config = copy.deepcopy(drafter.generation_config)
    return model.eval()


def engine_snippet(
    engine: str,
    model_dir: str,
    target: str,
    window_length: int,
    num_sink_tokens: int,
    num_speculative_tokens: int,
) -> dict:
    """What `engine` needs to serve the export at `model_dir` as `target`'s draft: `{"command": str, ...}`."""
    check_options(engine, window_length, num_sink_tokens, num_speculative_tokens)
    if engine == "vllm":
        speculative_config = {
            "method": "draft_model",
            "model": model_dir,
            "num_speculative_tokens": num_speculative_tokens,
        }
        command = f"vllm serve {shlex.quote(target)} --speculative-config {shlex.quote(json.dumps(speculative_config))}"
        return {"command": command, "speculative_config": speculative_config}
    flags = [
        "--speculative-algorithm", "STANDALONE",
        "--speculative-draft-model-path", model_dir,
        "--speculative-num-steps", str(num_speculative_tokens),
        "--speculative-eagle-topk", "1",
        "--speculative-num-draft-tokens", str(num_speculative_tokens + 1),
        "--speculative-draft-window-size", str(window_length),
        "--speculative-draft-sink-size", str(num_sink_tokens),
        "--speculative-draft-attention-backend", "triton",
    ]  # fmt: skip
    command = " ".join(["python -m sglang.launch_server --model-path", *map(shlex.quote, [target, *flags])])
    return {"command": command, "flags": flags}


def _readme(engine: str, snippet: dict, window_length: int, num_sink_tokens: int) -> str:
    """The export folder's README: what was written and how to serve it."""
    window = (
        f"`sliding_window = {window_length + 1}` on every layer (the {window_length} most recent past tokens)"
    )
    notes = {
        "vllm": "vLLM applies the config's window to every draft layer (prefill included); it keeps no sink.",
        "sglang": (
            "SGLang's Llama/Mistral models ignore the config's window; the draft-window flags below restrict "
            f"each draft-decode step to {num_sink_tokens} sink + {window_length} recent tokens (Triton/FlashInfer "
            "draft attention; the drafter's extend pass over new tokens stays full)."
        ),
    }
    return (
        "# Sliding-window drafter exported by hf-budgetdraft\n\n"
        f"A plain `MistralForCausalLM` checkpoint (safetensors) with {window}; weights unchanged. "
        "`AutoModelForCausalLM.from_pretrained(this_folder)` runs it windowed in transformers.\n\n"
        f"{notes[engine]}\n\n```bash\n{snippet['command']}\n```\n"
    )


def _check_output_dir(path: Path, overwrite: bool) -> None:
    """Refuse a file, a non-empty folder, or (with `overwrite`) a non-empty folder no export wrote."""
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"output_dir {str(path)!r} is a file; pass a folder path")
    if not path.is_dir() or not any(path.iterdir()):
        return
    if not overwrite:
        raise FileExistsError(
            f"output_dir {str(path)!r} is not empty; pass overwrite=True (--overwrite) to replace an earlier export, "
            "or choose a new folder"
        )
    if not (path / MARKER).is_file():
        raise FileExistsError(
            f"output_dir {str(path)!r} is not empty and holds no {MARKER}, so it is not an earlier export; "
            "overwrite only replaces exports: choose a new or empty folder"
        )


def export_drafter(
    drafter: PreTrainedModel,
    output_dir: str | os.PathLike,
    *,
    engine: str,
    window_length: int = DEFAULT_WINDOW,
    num_sink_tokens: int = 0,
    num_speculative_tokens: int = 6,
    tokenizer=None,
    target: str = "TARGET_MODEL",
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
) -> Path:
    """Write `drafter` as a sliding-window HF checkpoint for `engine` into `output_dir`; return that folder.

    The folder holds `model.safetensors`, `config.json` (`MistralForCausalLM`, `sliding_window = window_length + 1`
    on every layer), `generation_config.json`, the tokenizer (if given), `README.md` with the engine's command
    line, and `serving.json` (the same, machine-readable). It is written next to `output_dir` first and moved into
    place, so a failed export leaves no half-written folder.
    """
    check_options(engine, window_length, num_sink_tokens, num_speculative_tokens)
    if not isinstance(drafter, PreTrainedModel):
        raise TypeError(f"drafter must be a transformers PreTrainedModel, got {type(drafter).__name__}")
    if dtype is not None and dtype not in _DTYPES.values():
        raise ValueError(f"dtype must be one of {list(_DTYPES.values())} or None, got {dtype!r}")
    path = Path(output_dir).expanduser().resolve()
    _check_output_dir(path, overwrite)
    model = sliding_window_model(drafter, window_length)
    if dtype is not None:
        model = model.to(dtype)
        model.config.dtype = dtype
    snippet = engine_snippet(
        engine, str(path), target, window_length, num_sink_tokens, num_speculative_tokens
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        _write(staging, model, tokenizer, engine, snippet, window_length, num_sink_tokens)
        if path.exists():
            shutil.rmtree(path)
        os.replace(staging, path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return path


def _write(
    folder: Path, model, tokenizer, engine: str, snippet: dict, window_length: int, sinks: int
) -> None:
    model.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    (folder / "README.md").write_text(_readme(engine, snippet, window_length, sinks), encoding="utf-8")
    record = {
        "exported_by": "hf-budgetdraft",
        "engine": engine,
        "window_length": window_length,
        "sliding_window": window_length + 1,
        "num_sink_tokens": sinks,
        **snippet,
    }
    (folder / MARKER).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


def _load(args: ExportArguments):
    """`(drafter, tokenizer or None, target for the command line)` the arguments name."""
    if args.drafter is None:
        from .demo import load_demo_models
        from .demo.models import DEMO_DIR

        demo = load_demo_models()
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer) if args.tokenizer else demo.tokenizer
        return demo.drafter, tokenizer, args.target or str(DEMO_DIR / "target")
    folder = Path(args.drafter)
    if (folder / "adapter_config.json").is_file() and not (folder / "config.json").is_file():
        raise ValueError(
            f"{args.drafter!r} is a PEFT adapter; export the merged model (`hf-budgetdraft train` saves one beside "
            "the adapter, or merge it with `merge_and_unload()` and save_pretrained)"
        )
    drafter = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, use_safetensors=True, local_files_only=True
    ).eval()
    return drafter, _optional_tokenizer(args.tokenizer or folder), args.target or "TARGET_MODEL"


def _optional_tokenizer(path):
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError):
        return None


def export_command(args: ExportArguments) -> int:
    """`hf-budgetdraft export`: write the checkpoint and print how to serve it."""
    try:
        _check_output_dir(
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
            dtype=_DTYPES[args.dtype],
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


__all__ = [
    "ENGINES",
    "ExportArguments",
    "check_options",
    "engine_snippet",
    "export_command",
    "export_drafter",
    "sliding_window_config",
    "sliding_window_model",
]
