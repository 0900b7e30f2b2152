"""Training data for BudgetDraft: text -> packed rows of `prefix_length + continuation_length` token ids, and,
optionally, teacher targets computed once with `datasets.map` and cached on disk.

The paper packs PG-19 books into 16,384-token rows (16,128 prefix + 256 continuation). Here:

- `load_text_dataset`: local text files/folders (`.txt`/`.md` read whole, one row per file; `.json`/`.jsonl` with a
  text column), or a `datasets` name when online (e.g. `"emozilla/pg19"`);
- `pack_dataset`: tokenize and cut into rows of exactly `sequence_length` ids (column `input_ids`);
- `precompute_teacher_targets`: the frozen target's greedy next tokens over each row's continuation (column
  `teacher_labels`, `(C,)`) and optionally its top-k log-probabilities for the soft loss (`teacher_topk_ids`,
  `teacher_topk_logprobs`, `(C, k)`). The teacher is the expensive part of a step: precomputing it once lets
  many drafter runs (budgets, λ, policies) reuse it;
- `generate_target_continuations`: each row's continuation replaced by the target's own continuation of its
  prefix, greedy or (a share of the rows) sampled (on-policy rows: at inference the drafter reads the target's
  output, not human text);
- `BudgetDraftCollator`: stacks rows into tensors and refuses rows shorter than prefix + continuation.
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

TEXT_SUFFIXES = (".txt", ".md", ".text")
JSON_SUFFIXES = (".json", ".jsonl")
TEACHER_COLUMNS = ("teacher_labels", "teacher_topk_ids", "teacher_topk_logprobs")


def find_data_files(paths: str | list[str]) -> list[str]:
    """Expand files and folders (recursively, sorted) into the text/JSON files they hold."""
    paths = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
    files: list[str] = []
    for path in map(Path, paths):
        if path.is_dir():
            files += sorted(
                str(p) for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES + JSON_SUFFIXES
            )
        elif path.is_file():
            files.append(str(path))
        else:
            raise ValueError(f"data file or folder {str(path)!r} does not exist")
    if not files:
        raise ValueError(
            f"no {'/'.join(TEXT_SUFFIXES + JSON_SUFFIXES)} files found under {[str(p) for p in paths]}; point "
            "--data_files at text files or folders holding them"
        )
    return files


def load_text_dataset(
    data_files: str | list[str] | None = None,
    dataset_name: str | None = None,
    dataset_config_name: str | None = None,
    split: str = "train",
    text_column: str = "text",
):
    """A `datasets.Dataset` with one document per row in column `text_column`.

    Args:
        data_files (`str` or `list[str]`, *optional*): local files or folders. Text files are read whole (one row
            per file: long documents stay long); `.json`/`.jsonl` rows must have `text_column`.
        dataset_name (`str`, *optional*): a `datasets` name or path to load instead (needs network for hub names).
        dataset_config_name (`str`, *optional*): its configuration.
        split (`str`, defaults to `"train"`): split of `dataset_name`.
        text_column (`str`, defaults to `"text"`): the column holding the text.
    """
    import datasets

    if (data_files is None) == (dataset_name is None):
        raise ValueError("pass exactly one of data_files (local text) or dataset_name (a `datasets` name)")
    if dataset_name is not None:
        dataset = datasets.load_dataset(dataset_name, dataset_config_name, split=split)
    else:
        files = find_data_files(data_files)
        text = [f for f in files if not f.endswith(JSON_SUFFIXES)]
        json = [f for f in files if f.endswith(JSON_SUFFIXES)]
        parts = []
        if text:
            part = datasets.load_dataset("text", data_files=text, sample_by="document", split="train")
            parts.append(part.rename_column("text", text_column) if text_column != "text" else part)
        if json:
            parts.append(datasets.load_dataset("json", data_files=json, split="train"))
        for part in parts:
            if text_column not in part.column_names:
                raise ValueError(
                    f"JSON rows have columns {part.column_names}, no {text_column!r}; pass --text_column with the "
                    "name of the text field"
                )
        parts = [part.select_columns([text_column]) for part in parts]
        dataset = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
    if text_column not in dataset.column_names:
        raise ValueError(
            f"dataset has columns {dataset.column_names}, no {text_column!r}; pass --text_column"
        )
    return dataset


def pack_dataset(
    dataset,
    tokenizer,
    sequence_length: int,
    text_column: str = "text",
    add_eos: bool = True,
    across_documents: bool = True,
    num_proc: int | None = None,
    batch_size: int = 256,
):
    """Tokenize `dataset[text_column]` and cut it into rows of exactly `sequence_length` ids (`input_ids`).

    Args:
        dataset (`datasets.Dataset`): documents.
        tokenizer: a tokenizer callable returning `{"input_ids": list[list[int]]}` (e.g. the target's).
        sequence_length (`int`): prefix_length + continuation_length.
        add_eos (`bool`, defaults to `True`): append the EOS token after each document (when the tokenizer has one).
        across_documents (`bool`, defaults to `True`): concatenate documents (within a map batch of `batch_size`
            documents) before cutting, dropping only the batch's last partial row; `False` cuts each document
            alone (every row is one document's context; shorter documents are dropped).
        num_proc (`int`, *optional*): worker processes for `datasets.map`.
    """
    if sequence_length < 2:
        raise ValueError(f"sequence_length must be >= 2, got {sequence_length}")
    eos = getattr(tokenizer, "eos_token_id", None) if add_eos else None

    def pack(batch):
        documents = tokenizer(batch[text_column])["input_ids"]
        if eos is not None:
            documents = [ids + [eos] for ids in documents]
        streams = [[t for ids in documents for t in ids]] if across_documents else documents
        rows = [
            stream[start : start + sequence_length]
            for stream in streams
            for start in range(0, len(stream) - sequence_length + 1, sequence_length)
        ]
        return {"input_ids": rows}

    packed = dataset.map(
        pack,
        batched=True,
        batch_size=batch_size,
        remove_columns=dataset.column_names,
        num_proc=num_proc,
        desc=f"packing into rows of {sequence_length} tokens",
    )
    if len(packed) == 0:
        raise ValueError(
            f"no row of {sequence_length} tokens could be packed from {len(dataset)} document(s): the text is shorter "
            "than prefix_length + continuation_length. Add text or lower the lengths."
        )
    return packed


def check_row_lengths(dataset, prefix_length: int, continuation_length: int) -> None:
    """Raise `ValueError` naming the first row of `dataset` shorter than `prefix_length + continuation_length`.

    Map-style datasets are checked in full from the Arrow column lengths (no Python pass over the ids); other
    datasets are checked row by row by `BudgetDraftCollator`.
    """
    import datasets

    needed = prefix_length + continuation_length
    if not isinstance(dataset, datasets.Dataset):
        return  # streaming / torch datasets: BudgetDraftCollator checks each row
    if "input_ids" not in dataset.column_names:
        raise ValueError(f"the dataset needs an input_ids column, got columns {dataset.column_names}")
    if dataset._indices is None:  # the Arrow column as stored: lengths without a Python pass over the ids
        import pyarrow.compute as pc

        lengths = pc.list_value_length(dataset.data.column("input_ids")).to_pylist()
    else:  # a selection/shuffle of rows
        lengths = [len(row) for row in dataset["input_ids"]]
    short = [i for i, n in enumerate(lengths) if n is None or n < needed]
    if short:
        raise ValueError(
            f"{len(short)} of {len(lengths)} rows are shorter than prefix_length + continuation_length = "
            f"{prefix_length} + {continuation_length} = {needed} tokens (row {short[0]} has {lengths[short[0]]}). "
            "Pack the text with pack_dataset(..., sequence_length=prefix_length + continuation_length) or lower the "
            "lengths."
        )


def _teacher_fingerprint(dataset, teacher, prefix_length, continuation_length, top_k, temperature) -> str:
    digest = hashlib.sha256()
    digest.update(str(getattr(dataset, "_fingerprint", len(dataset))).encode())
    digest.update(teacher.config.to_json_string(use_diff=False).encode())
    digest.update(
        f"{teacher.config.name_or_path}|{prefix_length}|{continuation_length}|{top_k}|{temperature}".encode()
    )
    with (
        torch.no_grad()
    ):  # a cheap weight digest: a stale cache after retraining the target must not be reused
        for name, param in teacher.named_parameters():
            digest.update(name.encode())
            digest.update(param.detach().flatten()[:256].float().cpu().numpy().tobytes())
    return digest.hexdigest()[:32]


def _cached_map(
    dataset,
    function,
    batch_size: int,
    fingerprint: str,
    cache_dir: str | None,
    name: str,
    desc: str,
    with_indices: bool = False,
):
    """`dataset.map(function)` in batches, fingerprinted, cached as `cache_dir/{name}-{fingerprint}.arrow`."""
    cache_file_name = None
    if cache_dir is not None:
        os.makedirs(cache_dir, exist_ok=True)
        cache_file_name = os.path.join(cache_dir, f"{name}-{fingerprint}.arrow")
    return dataset.map(
        function,
        batched=True,
        batch_size=batch_size,
        with_indices=with_indices,
        new_fingerprint=fingerprint,
        cache_file_name=cache_file_name,
        load_from_cache_file=True,
        desc=desc,
    )


def precompute_teacher_targets(
    dataset,
    teacher,
    prefix_length: int,
    continuation_length: int,
    top_k: int = 0,
    temperature: float = 1.0,
    batch_size: int = 1,
    cache_dir: str | None = None,
):
    """Add the frozen target's continuation targets to every row, computed once and cached.

    Args:
        dataset (`datasets.Dataset`): rows with `input_ids` of at least `prefix_length + continuation_length` ids.
        teacher (`PreTrainedModel`): the target, on the device it should run on.
        top_k (`int`, defaults to 0): also store the top-k log-probabilities (at `temperature`) for `loss="soft"`.
        batch_size (`int`, defaults to 1): rows per teacher forward.
        cache_dir (`str`, *optional*): folder of the cached Arrow file; a second call with the same dataset, teacher
            (config and weights) and settings loads it instead of running the teacher. Without it, `datasets`' own
            cache is used for datasets loaded from files.

    Returns:
        `datasets.Dataset` with `teacher_labels` `(C,)` and, when `top_k > 0`, `teacher_topk_ids` and
        `teacher_topk_logprobs` `(C, top_k)`: position `i` predicts token `prefix_length + i + 1`.
    """
    check_row_lengths(dataset, prefix_length, continuation_length)
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {top_k}")
    needed = prefix_length + continuation_length
    device = next(teacher.parameters()).device
    teacher.eval()

    def targets(batch):
        ids = torch.tensor([row[:needed] for row in batch["input_ids"]], device=device)  # (b, P + C)
        with torch.no_grad():
            logits = teacher(input_ids=ids, logits_to_keep=continuation_length).logits.float()  # (b, C, V)
        out = {"teacher_labels": logits.argmax(dim=-1).cpu().tolist()}
        if top_k:
            logprobs, token_ids = (logits / temperature).log_softmax(dim=-1).topk(top_k, dim=-1)  # (b, C, k)
            out["teacher_topk_ids"] = token_ids.cpu().tolist()
            out["teacher_topk_logprobs"] = logprobs.cpu().tolist()
        return out

    fingerprint = _teacher_fingerprint(
        dataset, teacher, prefix_length, continuation_length, top_k, temperature
    )
    return _cached_map(
        dataset, targets, batch_size, fingerprint, cache_dir, "teacher-targets", "teacher targets"
    )


def sampled_rows(num_rows: int, sampled_fraction: float) -> list[bool]:
    """Which of `num_rows` rows get a sampled continuation: `round(num_rows * sampled_fraction)` rows spread
    evenly (row `i` is sampled when `floor((i + 1) f) > floor(i f)`), so every stretch of the data holds the mix."""
    if not 0.0 <= sampled_fraction <= 1.0:
        raise ValueError(f"sampled_fraction must be in [0, 1], got {sampled_fraction}")
    return [
        math.floor((i + 1) * sampled_fraction) > math.floor(i * sampled_fraction) for i in range(num_rows)
    ]


def _continue(
    teacher, prefixes: list[list[int]], continuation_length: int, settings: dict
) -> list[list[int]]:
    """`teacher`'s continuations of equal-length `prefixes` `(b, P)`: `(b, P + C)` rows of exactly
    `continuation_length` new tokens each. `settings`: greedy, or sampled as a user's `do_sample` call samples (the
    target's generation config: top-k 50 unless it says)."""
    ids = torch.tensor(prefixes, device=next(teacher.parameters()).device)  # (b, P)
    with torch.no_grad():
        out = teacher.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=continuation_length,
            min_new_tokens=continuation_length,
            **settings,
        )  # (b, P + C)
    return out.cpu().tolist()


def generate_target_continuations(
    dataset,
    teacher,
    prefix_length: int,
    continuation_length: int,
    batch_size: int = 8,
    cache_dir: str | None = None,
    sampled_fraction: float = 0.0,
    temperature: float = 1.0,
    seed: int = 0,
):
    """Replace each row's continuation by the target's own continuation of its `prefix_length`-token prefix.

    At inference the drafter drafts the target's own output, which for a small target reads nothing like the
    human text the rows were cut from (it repeats itself, and keeps to what it knows). Training on the target's
    output aligns the training rows with the rows the drafter is verified on: "self-distillation" data, as in
    Medusa-2 and EAGLE's regenerated data. Greedy calls draft greedy text and sampling calls sampled text, so a
    drafter meant for both trains on both: `sampled_fraction` of the rows (spread evenly, `sampled_rows`) are
    continued by sampling at `temperature` (seeded per batch), the rest greedily. Each continuation has exactly
    `continuation_length` new tokens (`min_new_tokens`, as `hf-budgetdraft bench` runs it), `batch_size` rows at a
    time (equal-length prefixes: no padding).

    Args:
        dataset (`datasets.Dataset`): rows with `input_ids` of at least `prefix_length + continuation_length` ids.
        teacher (`PreTrainedModel`): the target.
        batch_size (`int`, defaults to 8): rows decoded together.
        cache_dir (`str`, *optional*): folder of the cached Arrow file (keyed by data, target weights, lengths and
            the sampling settings).
        sampled_fraction (`float`, defaults to 0): share of rows continued by sampling instead of greedily.
        temperature (`float`, defaults to 1): the sampling temperature of those rows.
        seed (`int`, defaults to 0): seeds the sampled rows (batch `b` draws with seed `seed + b`).

    Returns:
        `datasets.Dataset` with `input_ids` `(P + C,)`: the same prefix, then the target's C tokens.
    """
    check_row_lengths(dataset, prefix_length, continuation_length)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    sampled = sampled_rows(len(dataset), sampled_fraction)
    teacher.eval()

    def regenerate(batch, indices):
        out = list(batch["input_ids"])
        for do_sample in (False, True):
            chosen = [n for n, index in enumerate(indices) if sampled[index] == do_sample]
            if chosen:
                if do_sample:
                    torch.manual_seed(seed + indices[0])
                rows = [out[n][:prefix_length] for n in chosen]
                settings = (
                    {"do_sample": True, "temperature": temperature} if do_sample else {"do_sample": False}
                )
                for n, row in zip(
                    chosen, _continue(teacher, rows, continuation_length, settings), strict=True
                ):
                    out[n] = row
        return {"input_ids": out}

    mode = "greedy-continuation" if sampled_fraction == 0 else f"continuation|{sampled_fraction}|{seed}"
    fingerprint = _teacher_fingerprint(
        dataset, teacher, prefix_length, continuation_length, mode, temperature if sampled_fraction else 0.0
    )
    return _cached_map(
        dataset,
        regenerate,
        batch_size,
        fingerprint,
        cache_dir,
        "target-continuations",
        "target's continuations",
        with_indices=True,
    )


@dataclass
class BudgetDraftCollator:
    """Stacks rows into `input_ids` `(B, prefix_length + continuation_length)` (+ teacher columns, if present)."""

    prefix_length: int
    continuation_length: int

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        needed = self.prefix_length + self.continuation_length
        for index, row in enumerate(rows):
            if len(row["input_ids"]) < needed:
                raise ValueError(
                    f"a row has {len(row['input_ids'])} tokens (batch row {index}), fewer than prefix_length + "
                    f"continuation_length = {needed}; pack the data with pack_dataset(sequence_length={needed})"
                )
        batch = {
            "input_ids": torch.tensor([list(row["input_ids"][:needed]) for row in rows], dtype=torch.long)
        }
        for column in TEACHER_COLUMNS:
            if column in rows[0]:
                values = torch.tensor([row[column] for row in rows])
                if values.shape[1] != self.continuation_length:
                    raise ValueError(
                        f"{column} covers {values.shape[1]} positions, expected continuation_length="
                        f"{self.continuation_length}; recompute the teacher targets for these lengths"
                    )
                batch[column] = values
        return batch
