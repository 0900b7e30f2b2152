"""The prompt of a run: a built-in task (`hf_budgetdraft.demo.tasks.build_sample` on the demo corpus) or the
visitor's pasted or uploaded text, cut to the requested context length."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ...demo.corpus import Document
from ...demo.tasks import build_sample
from ..arguments import AppArguments
from .request import SOURCE_LABELS, UPLOAD_SUFFIXES, DemoInputError, RunRequest
from .store import ModelPair


@dataclass
class Prompt:
    """The prompt of a run. `input_ids`: `(1, L)`; `description`: where it came from; `preview`: its tail."""

    input_ids: torch.LongTensor
    description: str
    preview: str


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


def build_prompt(
    request: RunRequest,
    pair: ModelPair,
    limits: AppArguments,
    documents: Callable[[], tuple[list[Document], str]],
) -> Prompt:
    """The prompt of `request` (a built-in task through `demo.tasks.build_sample`, or the visitor's text).
    `documents` returns the built-in corpus and its name (`ModelStore.builtin_documents`); only the document and
    code tasks call it."""
    if request.source == "text":
        ids, description = _text_prompt(request, pair.tokenizer, limits)
    else:
        ids, description = _task_prompt(request, pair.tokenizer, documents)
    preview = pair.tokenizer.decode(ids[0, -200:].tolist())
    return Prompt(ids, f"{description} — {ids.shape[1]} prompt tokens", preview)


def _text_prompt(request: RunRequest, tokenizer, limits: AppArguments) -> tuple[torch.LongTensor, str]:
    """The last `context_length` tokens of the pasted or uploaded text, and where they came from."""
    length = request.context_length
    text = read_upload(request.upload, limits) if request.upload else request.text
    ids = tokenizer(text, return_tensors="pt").input_ids[:, -length:]
    if ids.numel() == 0:
        raise DemoInputError("the text is empty once tokenized; paste some text")
    origin = "uploaded file" if request.upload else "pasted text"
    note = "" if ids.shape[1] == length else f" (shorter than the {length} requested: all of it)"
    return ids, f"{origin}: last {ids.shape[1]} tokens{note}"


def _task_prompt(
    request: RunRequest, tokenizer, documents: Callable[[], tuple[list[Document], str]]
) -> tuple[torch.LongTensor, str]:
    """A built-in task's prompt, and which documents (or where the passkey) it holds."""
    corpus_documents, corpus = documents() if request.source in ("document", "code") else (None, "")
    try:
        sample = build_sample(
            request.source,
            tokenizer,
            corpus_documents,
            request.context_length,
            request.max_new_tokens,
            seed=request.seed,
            passkey_depth=request.depth,
            num_sink_tokens=request.num_sink_tokens,
            window_length=request.window_length,
        )
    except ValueError as error:  # the task builders' messages say what to change
        raise DemoInputError(f"cannot build this context: {error}") from None
    ids, meta, label = sample.input_ids, sample.meta, SOURCE_LABELS[request.source]
    if request.source in ("document", "code"):
        names = meta.get("documents") or meta.get("files") or []
        description = f"{label} from {corpus}: {', '.join(map(str, names[:3]))}"
        if len(names) > 3:
            description += f" and {len(names) - 3} more"
        return ids, description
    where = meta["needle_position"] / ids.shape[1]
    return ids, (
        f"{label}: key {meta['key']} at token {meta['needle_position']} ({where:.0%} of the prompt); the answer is "
        "the key"
    )
