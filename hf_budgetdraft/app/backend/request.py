"""The visitor's request: the options the page offers (value -> label), and `RunRequest.check`, which holds every
choice to the server's bounds and turns a bad one into a `DemoInputError` that says what to fix."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ...cache.policies import POLICIES
from ...generation.spec import DraftSpec
from ...loading import DTYPES
from ..arguments import AppArguments

DEFAULT_SPEC = DraftSpec()  # the app's defaults are the package's

MODEL_DEMO = "demo"
MODEL_DEMO_BASE = "demo_base"
MODEL_SMOKE = "smoke"
MODEL_SMOKE_MTP = "smoke_mtp"
MODEL_LOCAL = "local"
DEFAULT_MODEL = MODEL_DEMO  # the bundled pair ships inside the package

MODEL_LABELS = {
    MODEL_DEMO: "Bundled demo pair: target + BudgetDraft-trained drafters (greedy / sampling)",
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

# the numeric fields and their types, in the order their errors are reported
_NUMBERS = (
    ("context_length", int),
    ("num_sink_tokens", int),
    ("window_length", int),
    ("budget", int),
    ("gamma", int),
    ("max_new_tokens", int),
    ("seed", int),
    ("depth", float),
    ("temperature", float),
)


class DemoInputError(ValueError):
    """A visitor input the app refuses; the message says what was wrong and how to fix it."""


def devices() -> list[str]:
    """The devices a visitor's own models may run on: the CPU and each GPU this server has."""
    return ["cpu", *(f"cuda:{index}" for index in range(torch.cuda.device_count()))]


def model_choices(allow_local: bool = True) -> list[tuple[str, str]]:
    """`(label, value)` pairs for the model selector, in `MODEL_LABELS` order: the bundled pair first, the random
    smoke models (they need nothing on disk), local folders when allowed."""
    return [(label, key) for key, label in MODEL_LABELS.items() if allow_local or key != MODEL_LOCAL]


@dataclass
class RunRequest:
    """Everything a visitor chose in the page. `check()` turns each bad value into a `DemoInputError`.

    Attributes:
        model (`str`): a key of `MODEL_LABELS`.
        target_path, drafter_path (`str`): model `"local"` only: a folder on the server or a hub id in its Hugging
            Face cache (never downloaded); the drafter may be empty for AR and MTP methods.
        device (`str`): model `"local"`: where the pair runs, one of `devices()`.
        dtype (`str`): model `"local"`: `auto` (the checkpoint's own), `float32`, `bfloat16` or `float16`.
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
    device: str = "cpu"
    dtype: str = "float32"
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
        request = RunRequest(**_coerced(dataclasses.asdict(self)))
        _check_ranges(request, limits)
        _check_choices(request, limits)
        _check_text(request, limits)
        return request


# the request's plain text fields (`upload`, a path or None, is coerced apart)
_STRINGS = tuple(f.name for f in dataclasses.fields(RunRequest) if f.type == "str")


def _coerced(values: dict) -> dict:
    """`values` with strings as strings and every `_NUMBERS` field as its type (an integral float is an int)."""
    for name in _STRINGS:
        values[name] = "" if values[name] is None else str(values[name])
    values["upload"] = str(values["upload"]) if values["upload"] else None
    values["sampling"] = bool(values["sampling"])
    for name, kind in _NUMBERS:
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
    return values


def _check_ranges(request: RunRequest, limits: AppArguments) -> None:
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


def _check_choices(request: RunRequest, limits: AppArguments) -> None:
    for name, options in (("model", MODEL_LABELS), ("source", SOURCE_LABELS), ("method", METHOD_LABELS)):
        if getattr(request, name) not in options:
            raise DemoInputError(f"unknown {name} {getattr(request, name)!r}; choose one of {list(options)}")
    if request.model == MODEL_LOCAL and not limits.allow_local_models:
        raise DemoInputError(
            "this server does not load model folders by path (it was started with --share; restart it with "
            "--allow_local_models true to allow it)"
        )
    if request.device not in devices():
        raise DemoInputError(f"unknown device {request.device!r}; this server has {devices()}")
    if request.dtype != "auto" and request.dtype not in DTYPES:
        raise DemoInputError(f"unknown dtype {request.dtype!r}; choose one of {['auto', *DTYPES]}")
    if request.method == "budgeted" and request.policy not in POLICIES:
        raise DemoInputError(f"unknown policy {request.policy!r}; choose one of {list(POLICY_NAMES)}")


def _check_text(request: RunRequest, limits: AppArguments) -> None:
    if request.source == "text" and not request.upload and not request.text.strip():
        raise DemoInputError(
            "the text is empty: paste some text or upload a text file, or pick a built-in context"
        )
    if len(request.text) > limits.max_text_chars:
        raise DemoInputError(
            f"the pasted text has {len(request.text):,} characters, more than this app's limit of "
            f"{limits.max_text_chars:,}; paste less (only the last context-length tokens are used anyway)"
        )


def _title(name: str) -> str:
    return {"gamma": "γ (draft tokens per round)", "num_sink_tokens": "sink tokens"}.get(
        name, name.replace("_", " ")
    )
