"""A trained drafter as a plain HF checkpoint a serving engine loads as its draft model, with the window the draft
reads declared in its config, plus the engine's command line (`export_drafter`; `hf-budgetdraft export --for
vllm|sglang` on the command line).

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
import tempfile
from pathlib import Path

import torch
from transformers import (
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
)

from .cache.sizes import check_size
from .generation.spec import MAX_DRAFT_LENGTH, DraftSpec
from .loading import DTYPES

ENGINES = ("vllm", "sglang")
MARKER = "serving.json"  # written by every export; `overwrite` only replaces a folder that holds it
DEFAULT_WINDOW = DraftSpec(cache="sink_window").window_length
# Llama-architecture drafters whose weights a Mistral model holds unchanged (no attention/MLP bias, silu MLP)
_FAMILIES = ("llama", "mistral", "ministral")
_MISTRAL_FIELDS = set(MistralConfig.__dataclass_fields__)


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


def check_output_dir(path: Path, overwrite: bool) -> None:
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
    if dtype is not None and dtype not in DTYPES.values():
        raise ValueError(f"dtype must be one of {list(DTYPES.values())} or None, got {dtype!r}")
    path = Path(output_dir).expanduser().resolve()
    check_output_dir(path, overwrite)
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


__all__ = [
    "DTYPES",
    "ENGINES",
    "MARKER",
    "check_output_dir",
    "check_options",
    "engine_snippet",
    "export_drafter",
    "sliding_window_config",
    "sliding_window_model",
]
