"""What the demo app runs, without any Gradio: models, prompts, and the two streamed generations it compares.

Everything here calls the library: the prompts come from `hf_budgetdraft.eval.tasks`, the generations are plain
`generate()` calls with the public `cache_implementation` / `cache_config` / `assistant_model` / `use_mtp` API, the
numbers from `record_speculation()` and `cache_nbytes`, and the losslessness check from
`hf_budgetdraft.eval.greedy_diff`. The app adds only input checks, streaming and bookkeeping for display.

A comparison (`compare`) runs plain AR first and the chosen speculative method second, on the same prompt and the
same cores, one after the other so that their timings compare; each yields a `Snapshot` after every emitted chunk.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import queue
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from .. import demo as demo_package
from ..cache.base import cache_nbytes
from ..cache.policies import POLICIES
from ..corpus import Document
from ..demo.documents import demo_documents
from ..eval.greedy_diff import divergence_margin, token_diff
from ..eval.metrics import acceptance_intervals
from ..eval.runners import configure_drafter
from ..eval.tasks import build_sample
from ..generation.mtp import expose_mtp_layers
from ..generation.spec import DraftSpec
from ..generation.stats import SpeculationStats, record_speculation
from ..quiet import quiet_transformers
from ..random_models import smoke_mtp_model, smoke_pair
from .config import AppArguments

DEFAULT_SPEC = DraftSpec()  # the app's defaults are the package's

logger = logging.getLogger(__name__)

TOKENIZER_DIR = Path(__file__).resolve().parent.parent / "demo" / "tokenizer"

# ---------------------------------------------------------------------------------------------------------------
# Choices shown in the page (value -> label)
# ---------------------------------------------------------------------------------------------------------------

MODEL_DEMO = "demo"
MODEL_DEMO_BASE = "demo_base"
MODEL_SMOKE = "smoke"
MODEL_SMOKE_MTP = "smoke_mtp"
MODEL_LOCAL = "local"

MODEL_LABELS = {
    MODEL_DEMO: "Bundled demo pair: target + BudgetDraft-trained drafter",
    MODEL_DEMO_BASE: "Bundled demo pair: target + base drafter (before BudgetDraft)",
    MODEL_SMOKE: "Smoke pair: tiny RANDOM weights (checks losslessness and the UI, not quality)",
    MODEL_SMOKE_MTP: "Smoke MTP model: tiny RANDOM weights + random MTP head (checks windowed MTP, not quality)",
    MODEL_LOCAL: "Local model folders (target + drafter, safetensors)",
}

SOURCE_LABELS = {
    "document": "Long document (built-in corpus)",
    "code": "Source code (built-in corpus)",
    "passkey": "Passkey hidden at a chosen depth",
    "needle_outside_window": "Needle just outside the draft's window",
    "text": "Your text (paste or upload)",
}

METHOD_LABELS = {
    "ar": "AR only (the target alone)",
    "native": "Native: drafter on a full cache (stock transformers)",
    "sink_window": "sink_window: drafter reads sink + recent window",
    "budgeted": "budgeted: drafter reads a selected budget + window",
    "mtp_native": "MTP: the model's own MTP head, full cache",
    "mtp_windowed": "Windowed MTP: MTP head reads sink + window",
}
DRAFTER_METHODS = ("native", "sink_window", "budgeted")
MTP_METHODS = ("mtp_native", "mtp_windowed")
POLICY_NAMES = tuple(sorted(POLICIES))

UPLOAD_SUFFIXES = (".txt", ".md", ".rst", ".py", ".json", ".jsonl", ".csv", ".tex", ".c", ".h", ".js", ".ts")


class DemoInputError(ValueError):
    """A visitor input the app refuses; the message says what was wrong and how to fix it."""


def demo_models_available() -> bool:
    """Whether this version bundles trained demo models (`hf_budgetdraft.demo.load_demo_models`)."""
    return callable(getattr(demo_package, "load_demo_models", None))


def model_choices(allow_local: bool = True) -> list[tuple[str, str]]:
    """`(label, value)` pairs for the model selector: the bundled pair first when it exists, the random smoke
    models always (they need nothing on disk), local folders when allowed."""
    keys = [MODEL_DEMO, MODEL_DEMO_BASE] if demo_models_available() else []
    keys += [MODEL_SMOKE, MODEL_SMOKE_MTP] + ([MODEL_LOCAL] if allow_local else [])
    return [(MODEL_LABELS[key], key) for key in keys]


def default_model() -> str:
    return MODEL_DEMO if demo_models_available() else MODEL_SMOKE


# ---------------------------------------------------------------------------------------------------------------
# The visitor's request
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class RunRequest:
    """Everything a visitor chose in the page. `check()` turns each bad value into a `DemoInputError`.

    Attributes:
        model (`str`): a key of `MODEL_LABELS`.
        target_path, drafter_path (`str`): local model folders (model `"local"` only; the drafter may be empty for
            AR and MTP methods).
        source (`str`): a key of `SOURCE_LABELS`.
        text (`str`): pasted text (source `"text"`).
        upload (`str`, *optional*): path of an uploaded text file (source `"text"`; replaces `text`).
        depth (`float`): passkey depth, 0 = start of the haystack, 1 = its end.
        context_length (`int`): prompt tokens (pasted text: its last `context_length` tokens).
        method (`str`): a key of `METHOD_LABELS`.
        policy (`str`): budgeted selection policy.
        num_sink_tokens, window_length, budget (`int`): the draft cache's sizes.
        gamma (`int`): draft tokens per round; 0 = adaptive (the package's default: chosen each round from the
            call's costs and acceptance; stock assisted generation then uses transformers' own default). MTP:
            fixed by the model's MTP depth.
        max_new_tokens (`int`): tokens each run generates at most.
        sampling (`bool`): sample (speculative sampling keeps the target's distribution) instead of greedy.
        temperature (`float`): sampling temperature.
        seed (`int`): seeds the prompt builders and the sampler.
    """

    model: str = MODEL_SMOKE
    target_path: str = ""
    drafter_path: str = ""
    source: str = "document"
    text: str = ""
    upload: str | None = None
    depth: float = 0.5
    context_length: int = 1024
    method: str = DEFAULT_SPEC.cache
    policy: str = DEFAULT_SPEC.policy
    num_sink_tokens: int = DEFAULT_SPEC.num_sink_tokens
    window_length: int = DEFAULT_SPEC.window_length
    budget: int = DEFAULT_SPEC.budget
    gamma: int = 0
    max_new_tokens: int = 48
    sampling: bool = False
    temperature: float = 1.0
    seed: int = 0

    def check(self, limits: AppArguments) -> RunRequest:
        """A copy with numbers coerced to their types, or a `DemoInputError` naming the field, value and bound."""
        values = dataclasses.asdict(self)
        for name in ("model", "target_path", "drafter_path", "source", "text", "method", "policy"):
            values[name] = "" if values[name] is None else str(values[name])
        values["upload"] = str(values["upload"]) if values["upload"] else None
        values["sampling"] = bool(values["sampling"])
        for name, kind in (
            ("context_length", int),
            ("num_sink_tokens", int),
            ("window_length", int),
            ("budget", int),
            ("gamma", int),
            ("max_new_tokens", int),
            ("seed", int),
            ("depth", float),
            ("temperature", float),
        ):
            raw = values[name]
            try:
                value = kind(raw)
                if kind is int and value != float(raw):
                    raise ValueError
            except (TypeError, ValueError, OverflowError):
                raise DemoInputError(
                    f"{_title(name)} must be a{'n integer' if kind is int else ' number'}, got {raw!r}"
                ) from None
            values[name] = value
        request = RunRequest(**values)
        for name, low, high, flag in (
            ("context_length", 16, limits.max_context_length, "--max_context_length"),
            ("max_new_tokens", 1, limits.max_new_tokens, "--max_new_tokens"),
            ("gamma", 0, limits.max_gamma, "--max_gamma"),
            ("window_length", 1, limits.max_window_length, "--max_window_length"),
            ("budget", 1, limits.max_budget, "--max_budget"),
            ("num_sink_tokens", 0, limits.max_sink_tokens, "--max_sink_tokens"),
            ("seed", 0, 2**31 - 1, None),
        ):
            value = getattr(request, name)
            if not low <= value <= high:
                raise DemoInputError(
                    f"{_title(name)} = {value} is outside this app's limits [{low}, {high}]; pick a value in range"
                    + (f" (the server sets the upper bound with {flag})" if flag else "")
                )
        if not 0.0 <= request.depth <= 1.0:
            raise DemoInputError(f"passkey depth must be in [0, 1] (0 = start, 1 = end), got {request.depth}")
        if request.sampling and not 0.05 <= request.temperature <= 5.0:
            raise DemoInputError(f"temperature must be in [0.05, 5], got {request.temperature}")
        for name, options in (("model", MODEL_LABELS), ("source", SOURCE_LABELS), ("method", METHOD_LABELS)):
            if getattr(request, name) not in options:
                raise DemoInputError(
                    f"unknown {name} {getattr(request, name)!r}; choose one of {list(options)}"
                )
        if request.model in (MODEL_DEMO, MODEL_DEMO_BASE) and not demo_models_available():
            raise DemoInputError(
                "the bundled demo models are not in this version yet (hf_budgetdraft.demo.load_demo_models() is "
                "missing); choose the smoke pair or your own model folders"
            )
        if request.model == MODEL_LOCAL and not limits.allow_local_models:
            raise DemoInputError(
                "this server does not load model folders by path (it was started with --share; restart it with "
                "--allow_local_models true to allow it)"
            )
        if request.method == "budgeted" and request.policy not in POLICIES:
            raise DemoInputError(f"unknown policy {request.policy!r}; choose one of {list(POLICY_NAMES)}")
        if request.source == "text" and not request.upload and not request.text.strip():
            raise DemoInputError(
                "the text is empty: paste some text or upload a text file, or pick a built-in context"
            )
        if len(request.text) > limits.max_text_chars:
            raise DemoInputError(
                f"the pasted text has {len(request.text):,} characters, more than this app's limit of "
                f"{limits.max_text_chars:,}; paste less (only the last context-length tokens are used anyway)"
            )
        return request


def _title(name: str) -> str:
    return {"gamma": "γ (draft tokens per round)", "num_sink_tokens": "sink tokens"}.get(
        name, name.replace("_", " ")
    )


# ---------------------------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class ModelPair:
    """Loaded models of one choice.

    Attributes:
        key (`str`): what identifies it in the store.
        title (`str`): how the page names it.
        tokenizer: the shared tokenizer.
        target (`PreTrainedModel`): verifies every token (full cache).
        drafter (`PreTrainedModel`, *optional*): the draft model (`None`: AR and MTP methods only).
        num_mtp_layers (`int`): the target's MTP depth (0: no MTP methods).
        random_weights (`bool`): random models (they check losslessness and the page, not speed or quality).
    """

    key: str
    title: str
    tokenizer: object
    target: torch.nn.Module
    drafter: torch.nn.Module | None
    num_mtp_layers: int = 0
    random_weights: bool = False

    def methods(self) -> list[str]:
        """The methods these models can run."""
        methods = ["ar"]
        if self.drafter is not None:
            methods += list(DRAFTER_METHODS)
        if self.num_mtp_layers:
            methods += list(MTP_METHODS)
        return methods


def _bundled_tokenizer():
    if not (TOKENIZER_DIR / "tokenizer.json").is_file():
        raise DemoInputError(
            f"the bundled tokenizer is missing from {TOKENIZER_DIR}; reinstall hf-budgetdraft"
        )
    return AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))


def _num_mtp_layers(model) -> int:
    return int(getattr(model.config.get_text_config(), "num_mtp_layers", None) or 0)


def check_model_folder(path: str, role: str, max_bytes: int) -> Path:
    """The folder of a local model, or a `DemoInputError` saying what is missing.

    Args:
        path (`str`): what the visitor typed (`~` is expanded).
        role (`str`): `"target"` or `"drafter"`, for the message.
        max_bytes (`int`): the most bytes of `.safetensors` weights the server accepts.
    """
    if not path or not path.strip():
        raise DemoInputError(f"enter the {role} model folder (a directory written by save_pretrained())")
    folder = Path(path.strip()).expanduser()
    if not folder.is_dir():
        raise DemoInputError(
            f"{role} model folder {path.strip()!r} does not exist on the server (or is not a directory); give the "
            "path of a folder written by save_pretrained() on this machine (hub names are not downloaded)"
        )
    if not (folder / "config.json").is_file():
        raise DemoInputError(
            f"{role} model folder {str(folder)!r} has no config.json; it must be a folder written by "
            "model.save_pretrained()"
        )
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        raise DemoInputError(
            f"{role} model folder {str(folder)!r} has no .safetensors weights; this app loads only safetensors "
            "(never pickled .bin files): re-save it with model.save_pretrained(path)"
        )
    size = sum(p.stat().st_size for p in weights)
    if size > max_bytes:
        raise DemoInputError(
            f"{role} model {str(folder)!r} holds {size / 2**30:.1f} GiB of weights, more than this server's limit "
            f"of {max_bytes / 2**30:.1f} GiB (--max_model_bytes)"
        )
    return folder


def _load_model(folder: Path, role: str):
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(folder), use_safetensors=True, local_files_only=True, dtype=torch.float32
        )
    except Exception as error:  # noqa: BLE001 - transformers raises many types; the visitor gets one message
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise DemoInputError(
            f"could not load the {role} from {str(folder)!r} as a causal LM ({type(error).__name__}: {first_line}). "
            "Models that need trust_remote_code are not loaded by this app."
        ) from None
    return model.eval()


def check_compatible(tokenizer, target, drafter, drafter_tokenizer=None) -> None:
    """Refuse a drafter that does not share the target's tokenizer and vocabulary (`DemoInputError`).

    Args:
        tokenizer: the target's tokenizer.
        target, drafter (`PreTrainedModel`): the pair.
        drafter_tokenizer (*optional*): the drafter folder's own tokenizer, when it has one.
    """
    target_vocab = target.config.get_text_config().vocab_size
    if len(tokenizer) > target_vocab:
        raise DemoInputError(
            f"the target's tokenizer has {len(tokenizer)} tokens but the target's vocabulary has only {target_vocab}; "
            "the folder's tokenizer does not belong to its model"
        )
    if drafter is None:
        return
    draft_vocab = drafter.config.get_text_config().vocab_size
    if draft_vocab != target_vocab:
        raise DemoInputError(
            f"incompatible models: the drafter's vocab_size={draft_vocab} differs from the target's {target_vocab}; "
            "a drafter must share the target's tokenizer and vocabulary (speculative decoding compares token ids)"
        )
    if drafter_tokenizer is not None:
        ours, theirs = tokenizer.get_vocab(), drafter_tokenizer.get_vocab()
        if ours != theirs:
            differing = sorted(set(ours.items()) ^ set(theirs.items()), key=lambda item: item[1])[:3]
            raise DemoInputError(
                f"incompatible tokenizers: the drafter's tokenizer ({len(theirs)} tokens) differs from the target's "
                f"({len(ours)} tokens), e.g. {differing}; a drafter must share the target's tokenizer"
            )


class ModelStore:
    """Loads each model choice once and keeps it (local folders: only the most recent pair, to bound memory).

    Args:
        limits (`AppArguments`): sizes the random smoke models and bounds local models.
    """

    def __init__(self, limits: AppArguments):
        self.limits = limits
        self._pairs: dict[str, ModelPair] = {}
        self._lock = threading.Lock()
        self._tmp: tempfile.TemporaryDirectory | None = None

    @property
    def max_positions(self) -> int:
        return self.limits.max_context_length + self.limits.max_new_tokens + self.limits.max_gamma + 8

    def get(self, model: str, target_path: str = "", drafter_path: str = "") -> ModelPair:
        """The `ModelPair` of a choice, loading it on first use (`DemoInputError` for bad folders)."""
        key = model if model != MODEL_LOCAL else f"local:{target_path.strip()}|{drafter_path.strip()}"
        with self._lock:
            if key not in self._pairs:
                if model == MODEL_LOCAL:  # one local pair at a time: a new one replaces the old
                    for old in [k for k in self._pairs if k.startswith("local:")]:
                        del self._pairs[old]
                with quiet_transformers():
                    self._pairs[key] = self._load(model, target_path, drafter_path, key)
            return self._pairs[key]

    def _load(self, model: str, target_path: str, drafter_path: str, key: str) -> ModelPair:
        if model in (MODEL_DEMO, MODEL_DEMO_BASE):
            demo = demo_package.load_demo_models()
            base = model == MODEL_DEMO_BASE
            drafter = demo.base_drafter if base else demo.drafter
            if drafter is None:
                raise DemoInputError("the bundled demo models have no base drafter; choose the trained one")
            target = demo.target.eval()
            return ModelPair(
                key, MODEL_LABELS[model], demo.tokenizer, target, drafter.eval(), _num_mtp_layers(target)
            )
        if model == MODEL_SMOKE:
            target, drafter = smoke_pair(seed=0, max_position_embeddings=self.max_positions)
            return ModelPair(key, MODEL_LABELS[model], _bundled_tokenizer(), target, drafter, 0, True)
        if model == MODEL_SMOKE_MTP:
            # transformers reads MTP weights from the checkpoint folder in every generate(): keep it for the app's life
            self._tmp = self._tmp or tempfile.TemporaryDirectory(prefix="hf_budgetdraft_app_")
            target = smoke_mtp_model(
                Path(self._tmp.name) / "smoke_mtp", seed=0, max_position_embeddings=self.max_positions
            )
            return ModelPair(
                key, MODEL_LABELS[model], _bundled_tokenizer(), target, None, _num_mtp_layers(target), True
            )
        # local folders
        target_folder = check_model_folder(target_path, "target", self.limits.max_model_bytes)
        drafter_folder = (
            check_model_folder(drafter_path, "drafter", self.limits.max_model_bytes)
            if drafter_path.strip()
            else None
        )
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(target_folder), local_files_only=True)
        except Exception as error:  # noqa: BLE001
            raise DemoInputError(
                f"the target folder {str(target_folder)!r} has no usable tokenizer ({type(error).__name__}); save "
                "one next to the model with tokenizer.save_pretrained(path)"
            ) from None
        drafter_tokenizer = None
        if drafter_folder is not None and any(
            (drafter_folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")
        ):
            try:
                drafter_tokenizer = AutoTokenizer.from_pretrained(str(drafter_folder), local_files_only=True)
            except Exception as error:  # noqa: BLE001
                raise DemoInputError(
                    f"the drafter folder's tokenizer could not be loaded ({type(error).__name__}); remove it to use "
                    "the target's, or fix it"
                ) from None
        target = _load_model(target_folder, "target")
        drafter = _load_model(drafter_folder, "drafter") if drafter_folder is not None else None
        check_compatible(tokenizer, target, drafter, drafter_tokenizer)
        mtp = _num_mtp_layers(target)
        if mtp:
            expose_mtp_layers(target)
        title = f"local: {target_folder}" + (f" + {drafter_folder}" if drafter_folder else "")
        return ModelPair(key, title, tokenizer, target, drafter, mtp, False)

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


# ---------------------------------------------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Prompt:
    """The prompt of a run. `input_ids`: `(1, L)`; `description`: where it came from; `preview`: its tail."""

    input_ids: torch.LongTensor
    description: str
    preview: str


_documents: tuple[list[Document], str] | None = None
_documents_lock = threading.Lock()


def builtin_documents() -> tuple[list[Document], str]:
    """The built-in corpus and its name (`hf_budgetdraft.demo.documents.demo_documents`), read once."""
    global _documents
    with _documents_lock:
        if _documents is None:
            _documents = demo_documents()
        return _documents


def read_upload(path: str, limits: AppArguments) -> str:
    """The text of an uploaded file, bounded by `--max_upload_bytes` / `--max_text_chars`."""
    file = Path(path)
    if not file.is_file():
        raise DemoInputError("the uploaded file is gone from the server; upload it again")
    size = file.stat().st_size
    if size > limits.max_upload_bytes:
        raise DemoInputError(
            f"the uploaded file has {size:,} bytes, more than this app's limit of {limits.max_upload_bytes:,}; upload "
            "a shorter text"
        )
    raw = file.read_bytes()
    if b"\x00" in raw[:4096]:
        raise DemoInputError(
            f"{file.name} looks binary; upload a UTF-8 text file ({', '.join(UPLOAD_SUFFIXES)})"
        )
    text = raw.decode("utf-8", errors="replace")
    if len(text) > limits.max_text_chars:
        raise DemoInputError(
            f"the uploaded text has more than {limits.max_text_chars:,} characters; upload less"
        )
    if not text.strip():
        raise DemoInputError(
            f"the uploaded file {file.name} is empty; upload a text file with some text in it"
        )
    return text


def build_prompt(request: RunRequest, pair: ModelPair, limits: AppArguments) -> Prompt:
    """The prompt of `request` (a built-in task through `eval.tasks.build_sample`, or the visitor's text)."""
    tokenizer = pair.tokenizer
    length = request.context_length
    if request.source == "text":
        text = read_upload(request.upload, limits) if request.upload else request.text
        ids = tokenizer(text, return_tensors="pt").input_ids[:, -length:]
        if ids.numel() == 0:
            raise DemoInputError("the text is empty once tokenized; paste some text")
        origin = "uploaded file" if request.upload else "pasted text"
        note = "" if ids.shape[1] == length else f" (shorter than the {length} requested: all of it)"
        description = f"{origin}: last {ids.shape[1]} tokens{note}"
    else:
        documents, corpus = builtin_documents() if request.source in ("document", "code") else (None, "")
        try:
            sample = build_sample(
                request.source,
                tokenizer,
                documents,
                length,
                request.max_new_tokens,
                seed=request.seed,
                passkey_depth=request.depth,
                num_sink_tokens=request.num_sink_tokens,
                window_length=request.window_length,
            )
        except ValueError as error:  # the task builders' messages say what to change
            raise DemoInputError(f"cannot build this context: {error}") from None
        ids = sample.input_ids
        meta = sample.meta
        if request.source in ("document", "code"):
            names = meta.get("documents") or meta.get("files") or []
            description = f"{SOURCE_LABELS[request.source]} from {corpus}: {', '.join(map(str, names[:3]))}"
            if len(names) > 3:
                description += f" and {len(names) - 3} more"
        else:
            where = meta["needle_position"] / ids.shape[1]
            description = (
                f"{SOURCE_LABELS[request.source]}: key {meta['key']} at token {meta['needle_position']} "
                f"({where:.0%} of the prompt); the answer is the key"
            )
    preview = tokenizer.decode(ids[0, -200:].tolist())
    return Prompt(ids, f"{description} — {ids.shape[1]} prompt tokens", preview)


# ---------------------------------------------------------------------------------------------------------------
# Streamed generation
# ---------------------------------------------------------------------------------------------------------------


class _QueueStreamer(BaseStreamer):
    """Hands each emitted chunk to the app's thread. `generate()` first puts the prompt (skipped), then one chunk
    per step: one token for AR, a round's accepted draft tokens plus the target's own token when speculating."""

    def __init__(self, sink: queue.Queue):
        self.sink = sink
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.sink.put(("chunk", value.reshape(-1).tolist(), time.perf_counter()))

    def end(self) -> None:
        pass


class _StopWhen(StoppingCriteria):
    """Stops `generate()` when one of `events` is set (the visitor cancelled, or the app's iterator was closed) or
    the time limit passed."""

    def __init__(self, events: tuple[threading.Event, ...], deadline: float):
        self.events, self.deadline = events, deadline

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        stop = any(event.is_set() for event in self.events) or time.perf_counter() > self.deadline
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)


@dataclass
class RunProgress:
    """One generation as it streams. `tokens`: the new token ids so far; `chunk_sizes`: tokens per emitted chunk;
    the rest is set when `done`."""

    tokens: list[int] = field(default_factory=list)
    chunk_sizes: list[int] = field(default_factory=list)
    done: bool = False
    stopped: bool = False  # cancelled or over the time limit before max_new_tokens
    seconds: float = math.nan
    first_chunk_seconds: float = math.nan
    stats: SpeculationStats | None = None
    draft_cache_bytes: int | None = None
    target_cache_bytes: int | None = None

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else math.nan

    @property
    def decode_tokens_per_second(self) -> float:
        """Throughput after the first emitted chunk, i.e. without the prefill (`nan` if nothing came after it)."""
        rest = len(self.tokens) - (self.chunk_sizes[0] if self.chunk_sizes else 0)
        duration = self.seconds - self.first_chunk_seconds
        return rest / duration if rest > 0 and duration > 0 else math.nan


_GENERATE_LOCK = threading.Lock()  # one generate() at a time in this process, whatever the web server does


def stream_generate(
    model,
    input_ids: torch.LongTensor,
    generate_kwargs: dict,
    seed: int = 0,
    cancel: threading.Event | None = None,
    max_seconds: float = math.inf,
) -> Iterator[RunProgress]:
    """Run `model.generate(input_ids, **generate_kwargs)` in a worker thread and yield its progress after every
    emitted chunk, then once more with `done=True` and the measurements.

    Generations run one at a time in the process (a lock held by the worker; timing starts once it holds it).
    Closing the iterator (the visitor left or pressed Stop) stops the generation at its next step and waits for
    the worker.

    Args:
        model (`PreTrainedModel`): the model whose `generate()` runs.
        input_ids (`torch.LongTensor` of shape `(1, L)`): the prompt.
        generate_kwargs (`dict`): `generate()` arguments (`max_new_tokens`, `do_sample`, `assistant_model`, ...).
        seed (`int`): `torch.manual_seed` before the call (sampling).
        cancel (`threading.Event`, *optional*): set it to stop the generation early.
        max_seconds (`float`): stop after this long (the output is then shorter than `max_new_tokens`).
    """
    cancel = cancel or threading.Event()
    closed = threading.Event()  # set when this iterator ends early (the page went away)
    events: queue.Queue = queue.Queue()
    progress = RunProgress()

    def work():
        try:
            with _GENERATE_LOCK:
                start = time.perf_counter()
                events.put(("start", start))
                torch.manual_seed(seed)
                stopping = StoppingCriteriaList([_StopWhen((cancel, closed), start + max_seconds)])
                with torch.inference_mode(), quiet_transformers(), record_speculation() as stats:
                    output = model.generate(
                        input_ids,
                        streamer=_QueueStreamer(events),
                        stopping_criteria=stopping,
                        return_dict_in_generate=True,
                        **generate_kwargs,
                    )
                    seconds = time.perf_counter() - start
                stopped = cancel.is_set() or closed.is_set() or time.perf_counter() > start + max_seconds
                draft_cache = stats.draft_cache
                draft_bytes = cache_nbytes(draft_cache) if draft_cache is not None else None
                stats.candidate_generator = None  # drop the draft cache now that it is measured
                target_bytes = cache_nbytes(output.cache) if output.cache is not None else None
            events.put(("done", seconds, stats, draft_bytes, target_bytes, stopped))
        except BaseException as error:  # noqa: BLE001 - re-raised in the app's thread
            events.put(("error", error))

    worker = threading.Thread(target=work, name="hf_budgetdraft-app-generate", daemon=True)
    worker.start()
    start = math.nan
    try:
        while True:
            event = events.get()
            if event[0] == "start":
                start = event[1]
            elif event[0] == "chunk":
                _, ids, when = event
                if not progress.tokens:
                    progress.first_chunk_seconds = when - start
                progress.tokens.extend(ids)
                progress.chunk_sizes.append(len(ids))
                yield progress
            elif event[0] == "done":
                (
                    _,
                    progress.seconds,
                    progress.stats,
                    progress.draft_cache_bytes,
                    progress.target_cache_bytes,
                    stopped,
                ) = event
                max_new = generate_kwargs.get("max_new_tokens")
                progress.stopped = stopped and max_new is not None and len(progress.tokens) < max_new
                progress.done = True
                yield progress
                return
            else:
                raise event[1]
    finally:
        closed.set()
        worker.join()


# ---------------------------------------------------------------------------------------------------------------
# One comparison: AR, then the speculative method
# ---------------------------------------------------------------------------------------------------------------


def token_origins(accepted_per_round: list[int], num_tokens: int) -> list[str]:
    """`"draft"` or `"target"` for each generated token, from the per-round accepted counts.

    Round r emits its `a_r` accepted draft tokens, then one token of the target's own: the correction at the first
    rejected draft, or the bonus token after a fully accepted draft. A round cut short by `max_new_tokens` or EOS
    is recorded with the drafts it kept (transformers recounts them), so the counts add up to the output.

    Args:
        accepted_per_round (`list[int]`): `SpeculationStats.accepted_per_round`.
        num_tokens (`int`): generated tokens (the result is cut or padded with `"target"` to this length).
    """
    origins: list[str] = []
    for accepted in accepted_per_round:
        origins += ["draft"] * int(accepted) + ["target"]
    return (origins + ["target"] * max(0, num_tokens - len(origins)))[:num_tokens]


def chunk_origins(chunk_sizes: list[int]) -> list[str]:
    """The same labels read off the streamed chunks (one chunk per round) while the run is still going."""
    return [origin for size in chunk_sizes for origin in ["draft"] * (size - 1) + ["target"]]


class IncrementalDecoder:
    """Text of each generated token such that the pieces concatenate to `tokenizer.decode(all_ids)`.

    Byte-level tokenizers split multi-byte characters over several tokens: such a token gets the empty string and
    the token that completes the character gets all of it (no stray replacement characters).
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.pieces: list[str] = []
        self._text = ""
        self._pending = 0  # tokens whose text is not complete yet

    def extend(self, ids: list[int], final: bool = False) -> list[str]:
        for token in ids:
            self.ids.append(token)
            self.pieces.append("")
            text = self.tokenizer.decode(self.ids)
            if text.endswith("\ufffd") and not final:
                self._pending += 1
                continue
            common = len(self._text) if text.startswith(self._text) else 0
            self.pieces[-1] = text[common:]
            self._text, self._pending = text, 0
        if final and self._pending:
            text = self.tokenizer.decode(self.ids)
            self.pieces[-1] += text[len(self._text) :] if text.startswith(self._text) else ""
            self._text, self._pending = text, 0
        return self.pieces


@dataclass
class SideView:
    """One output column: the token pieces and where each token came from (`"ar"`, `"draft"`, `"target"`)."""

    title: str
    pieces: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    origins: list[str] = field(default_factory=list)
    running: bool = False
    note: str = ""


@dataclass
class Snapshot:
    """What the page shows at one moment of a comparison."""

    status: str
    prompt: Prompt | None = None
    ar: SideView | None = None
    spec: SideView | None = None
    summary: dict | None = None
    acceptance: list[dict] | None = None
    error: bool = False


def full_kv_bytes(model, tokens: int, mtp: bool = False) -> int | None:
    """Bytes a full (uncompressed) KV cache of `model` would hold for `tokens` tokens, from its config (sliding
    layers capped at their window); with `mtp=True`, the cache of its MTP layers. An estimate for display: models
    with compressed attention (MLA) store less. `None` when the config does not say."""
    try:
        return _full_kv_bytes(model, tokens, mtp)
    except (AttributeError, TypeError, ValueError, StopIteration):
        return None


def _full_kv_bytes(model, tokens: int, mtp: bool) -> int:
    config = model.config.get_mtp_config() if mtp else model.config.get_text_config()
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = int(getattr(text, "num_mtp_layers", 0) or 0) if mtp else int(text.num_hidden_layers)
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    types = list(getattr(text, "layer_types", None) or []) if not mtp else []
    window = getattr(text, "sliding_window", None)
    element = next(model.parameters()).element_size()
    total = 0
    for layer in range(layers):
        kind = types[layer] if layer < len(types) else "full_attention"
        length = (
            min(tokens, window) if window and kind in ("sliding_attention", "chunked_attention") else tokens
        )
        total += 2 * kv_heads * head_dim * length * element
    return total


def draft_spec(request: RunRequest) -> DraftSpec:
    """The `DraftSpec` of a drafter request: its cache sizes, and γ = 0 for the adaptive draft length (the
    package's default) or a fixed γ."""
    cache = request.method
    sizes = {"window_length": request.window_length}
    if cache == "budgeted":
        sizes |= {"budget": request.budget, "policy": request.policy}
    else:
        sizes |= {"num_sink_tokens": request.num_sink_tokens}
    gamma = request.gamma or "adaptive"
    slack = max(DEFAULT_SPEC.slack, request.gamma)
    return DraftSpec(cache=cache, draft_length=gamma, slack=slack, **sizes)


def speculative_call(request: RunRequest, pair: ModelPair) -> tuple[dict, int]:
    """`generate()` arguments of the speculative method (beyond the decoding ones) and its γ (0: adaptive)."""
    method = request.method
    if method in MTP_METHODS:
        kwargs: dict = {"use_mtp": True}
        if method == "mtp_windowed":
            kwargs |= {
                "cache_implementation": "sink_window",
                "cache_config": {
                    "num_sink_tokens": request.num_sink_tokens,
                    "window_length": request.window_length,
                },
            }
        return kwargs, pair.num_mtp_layers
    kwargs = {"assistant_model": pair.drafter}
    if method in ("sink_window", "budgeted"):  # the request's spec alone decides the draft length
        configure_drafter(pair.drafter, None)
        spec = draft_spec(request)
        kwargs |= {"cache_implementation": spec.cache, "cache_config": spec.to_cache_config()}
    else:  # native: stock assisted generation reads a fixed γ from the drafter (0: transformers' default)
        configure_drafter(pair.drafter, request.gamma or None)
    return kwargs, request.gamma


def method_title(request: RunRequest, gamma: int) -> str:
    """Short name of the speculative run, e.g. `sink_window (S=16, W=256) γ=4`."""
    method = request.method
    if method == "sink_window":
        detail = f" (S={request.num_sink_tokens}, W={request.window_length})"
    elif method == "budgeted":
        detail = f" ({request.policy}, B={request.budget}, W={request.window_length})"
    elif method == "mtp_windowed":
        detail = f" (S={request.num_sink_tokens}, W={request.window_length})"
    else:
        detail = ""
    return f"{method}{detail} γ={gamma or 'adaptive'}"


def _decoding_kwargs(request: RunRequest, tokenizer) -> dict:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    kwargs = {"max_new_tokens": request.max_new_tokens, "pad_token_id": pad}
    if request.sampling:
        return kwargs | {"do_sample": True, "temperature": request.temperature, "top_k": 0, "top_p": 1.0}
    return kwargs | {"do_sample": False, "temperature": None, "top_k": None, "top_p": None}


def _require_method(request: RunRequest, pair: ModelPair) -> None:
    if request.method in pair.methods():
        return
    if request.method in MTP_METHODS:
        raise DemoInputError(
            f"{METHOD_LABELS[request.method]!r} needs a model with MTP layers (config.num_mtp_layers); "
            f"{pair.title!r} has none: choose the smoke MTP model or a checkpoint with an MTP head"
        )
    raise DemoInputError(
        f"{METHOD_LABELS[request.method]!r} needs a drafter and {pair.title!r} has none: enter a drafter folder, "
        "or choose AR only or an MTP method"
    )


def summarize(
    request: RunRequest,
    pair: ModelPair,
    prompt: Prompt,
    ar: RunProgress,
    spec: RunProgress | None,
    gamma: int,
) -> tuple[dict, list[dict] | None]:
    """The stats panel's numbers (JSON-ready) and the acceptance-per-position rows (Wilson 95% intervals)."""
    summary: dict = {
        "models": pair.title,
        "random_weights": pair.random_weights,
        "prompt_tokens": int(prompt.input_ids.shape[1]),
        "decoding": f"sampling (T={request.temperature})" if request.sampling else "greedy",
        "ar": {
            "new_tokens": len(ar.tokens),
            "seconds": ar.seconds,
            "tokens_per_second": ar.tokens_per_second,
            "decode_tokens_per_second": ar.decode_tokens_per_second,
            "target_cache_bytes": ar.target_cache_bytes,
            "stopped_early": ar.stopped,
        },
    }
    if spec is None:
        return _finite(summary), None
    stats = spec.stats or SpeculationStats()
    sequence = prompt.input_ids.shape[1] + len(spec.tokens)
    if request.method in MTP_METHODS:
        full_draft = full_kv_bytes(pair.target, sequence, mtp=True)
    else:
        full_draft = full_kv_bytes(pair.drafter, sequence)
    summary["speculative"] = {
        "method": method_title(request, gamma),
        "new_tokens": len(spec.tokens),
        "seconds": spec.seconds,
        "tokens_per_second": spec.tokens_per_second,
        "decode_tokens_per_second": spec.decode_tokens_per_second,
        "rounds": stats.rounds,
        "gamma": gamma,
        "mean_accepted_length": stats.mean_accepted_length,
        "acceptance_rate": stats.acceptance_rate,
        "draft_seconds": stats.draft_seconds,
        "verify_seconds": stats.verify_seconds,
        "draft_cache_bytes": spec.draft_cache_bytes,
        "full_draft_cache_bytes": full_draft,
        "stopped_early": spec.stopped,
    }
    summary["speed_up"] = spec.tokens_per_second / ar.tokens_per_second if ar.tokens_per_second else None
    if not request.sampling and not (ar.stopped or spec.stopped):
        reference, output = torch.tensor(ar.tokens), torch.tensor(spec.tokens)
        diff = token_diff(output, reference)
        check = {
            "identical": diff.diff_tokens == 0,
            "diff_tokens": diff.diff_tokens,
            "compared": diff.compared,
        }
        if diff.first_diff is not None and diff.first_diff < min(len(reference), len(output)):
            check["first_diff"] = diff.first_diff
            check["margin"] = divergence_margin(
                pair.target, prompt.input_ids, reference, output, diff.first_diff
            )
        summary["greedy_check"] = check
    counts = stats.acceptance_per_position()
    return _finite(summary), acceptance_intervals(counts) if counts else None


def _finite(value):
    """`nan`/`inf` → `None`, recursively (the stats travel as JSON)."""
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def compare(
    request: RunRequest,
    store: ModelStore,
    limits: AppArguments,
    cancel: threading.Event | None = None,
    refresh_seconds: float = 0.2,
) -> Iterator[Snapshot]:
    """Run AR and then the speculative method of `request`, yielding what the page should show as they stream.

    Bad input ends the iteration with one `Snapshot(error=True)` whose `status` says what to fix; nothing raises.

    Args:
        request (`RunRequest`): the visitor's choices (checked here).
        store (`ModelStore`): loaded models.
        limits (`AppArguments`): the server's bounds.
        cancel (`threading.Event`, *optional*): set to stop the running generation.
        refresh_seconds (`float`): at most one snapshot per this many seconds while tokens stream.
    """
    cancel = cancel or threading.Event()
    try:
        request = request.check(limits)
        yield Snapshot("Loading the models…")
        pair = store.get(request.model, request.target_path, request.drafter_path)
        _require_method(request, pair)
        prompt = build_prompt(request, pair, limits)
        decoding = _decoding_kwargs(request, pair.tokenizer)
        spec_kwargs, gamma = speculative_call(request, pair) if request.method != "ar" else ({}, 0)
    except DemoInputError as error:
        yield Snapshot(f"⚠ {error}", error=True)
        return
    except Exception as error:  # noqa: BLE001 - shown in the page, traceback in the server log
        logger.exception("demo app: preparing the run failed")
        yield Snapshot(f"⚠ Could not prepare the run: {type(error).__name__}: {error}", error=True)
        return

    ar_view = SideView("Plain AR (the target alone)", running=True)
    spec_view = (
        SideView(f"Speculative: {method_title(request, gamma)}", note="waits for the AR run")
        if spec_kwargs
        else None
    )
    snapshot = Snapshot("Running plain AR…", prompt, ar_view, spec_view)
    yield snapshot
    runs: dict[str, RunProgress] = {}
    for name, view, kwargs in (("ar", ar_view, {}), ("spec", spec_view, spec_kwargs)):
        if view is None:
            continue
        view.running, view.note = True, ""
        decoder = IncrementalDecoder(pair.tokenizer)
        snapshot.status = "Running plain AR…" if name == "ar" else f"Running {view.title}…"
        last = 0.0
        try:
            stream = stream_generate(
                pair.target,
                prompt.input_ids,
                decoding | kwargs,
                seed=request.seed,
                cancel=cancel,
                max_seconds=limits.max_run_seconds,
            )
            with contextlib.closing(stream):
                for progress in stream:
                    new = progress.tokens[len(decoder.ids) :]
                    view.pieces = list(decoder.extend(new, final=progress.done))
                    view.token_ids = list(decoder.ids)
                    if name == "ar":
                        view.origins = ["ar"] * len(view.token_ids)
                    elif progress.done and progress.stats is not None:
                        view.origins = token_origins(progress.stats.accepted_per_round, len(view.token_ids))
                    else:
                        view.origins = chunk_origins(progress.chunk_sizes)[: len(view.token_ids)]
                    now = time.perf_counter()
                    if progress.done or now - last >= refresh_seconds:
                        last = now
                        yield snapshot
            runs[name] = progress
        except (ValueError, DemoInputError) as error:  # the library's messages name the parameter and the fix
            view.running = False
            yield Snapshot(f"⚠ {view.title} failed: {error}", prompt, ar_view, spec_view, error=True)
            return
        except Exception as error:  # noqa: BLE001
            logger.exception("demo app: generation failed")
            view.running = False
            yield Snapshot(
                f"⚠ {view.title} failed: {type(error).__name__}: {error}",
                prompt,
                ar_view,
                spec_view,
                error=True,
            )
            return
        view.running = False
        if progress.stopped:
            view.note = (
                f"stopped early after {len(progress.tokens)} tokens (cancelled or over the time limit)"
            )
    try:
        summary, acceptance = summarize(request, pair, prompt, runs["ar"], runs.get("spec"), gamma)
    except Exception as error:  # noqa: BLE001 - the outputs stay; the numbers are missing
        logger.exception("demo app: summarizing the run failed")
        snapshot.status, snapshot.error = f"⚠ The runs finished but their stats failed: {error}", True
        yield snapshot
        return
    snapshot.summary, snapshot.acceptance = summary, acceptance
    snapshot.status = "Done." + (
        " Random weights: the numbers check the machinery, not quality or speed."
        if pair.random_weights
        else ""
    )
    yield snapshot
