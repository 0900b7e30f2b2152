"""Corpora: lists of `Document`s, read from local files, a `datasets` name, or the Python installation itself.

`load_documents` reads local text/code/JSONL files, `load_hub_documents` a `datasets` name (needs network), and
`stdlib_documents` builds an offline corpus from the running Python (prose from `pydoc_data`, code from the
standard library sources) for smoke runs. The eval task builders, the demo's documents and the app read these.
"""

from __future__ import annotations

import ast
import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path

CODE_SUFFIXES = frozenset(
    {
        ".py",
        ".c",
        ".h",
        ".cc",
        ".cpp",
        ".hpp",
        ".rs",
        ".go",
        ".java",
        ".js",
        ".ts",
        ".rb",
        ".sh",
        ".jl",
        ".scala",
    }
)
TEXT_SUFFIXES = frozenset({".txt", ".md", ".rst", ".tex"})
MAX_CORPUS_BYTES = 1 << 31  # bound on what a corpus loader reads (2 GiB)


@dataclass
class Document:
    """One document of a corpus: `kind` is `"text"` (prose) or `"code"` (source code)."""

    name: str
    text: str
    kind: str = "text"


def _kind_of(name: str) -> str:
    return "code" if Path(name).suffix.lower() in CODE_SUFFIXES else "text"


def load_documents(paths: list[str | Path], max_bytes: int = 256 << 20) -> list[Document]:
    """Read a local corpus: text/Markdown files (prose), source files (code), `.jsonl`/`.json` records, folders.

    A JSON(L) record is a dict with a `"text"` field; its `"name"` (or `"source"`) decides whether it is code
    (`source == "python"` or a code suffix in the name), as written by `scripts/prepare_corpus.py`.

    Args:
        paths (`list[str | Path]`): files or folders (read recursively, in sorted order).
        max_bytes (`int`): stop reading after this many bytes of text (bounded by `MAX_CORPUS_BYTES`).
    """
    if not 1 <= max_bytes <= MAX_CORPUS_BYTES:
        raise ValueError(f"max_bytes must be in [1, {MAX_CORPUS_BYTES}], got {max_bytes}")
    files: list[Path] = []
    for entry in map(Path, paths):
        if entry.is_dir():
            files += sorted(
                p
                for p in entry.rglob("*")
                if p.is_file() and p.suffix.lower() in CODE_SUFFIXES | TEXT_SUFFIXES | {".json", ".jsonl"}
            )
        elif entry.is_file():
            files.append(entry)
        else:
            raise ValueError(
                f"data file {str(entry)!r} does not exist; pass text/code/.jsonl files or folders"
            )
    documents: list[Document] = []
    total = 0
    for path in files:
        if total >= max_bytes:
            break
        suffix = path.suffix.lower()
        if suffix in (".jsonl", ".json"):
            raw = path.read_text(encoding="utf-8", errors="replace")
            lines = raw.splitlines() if suffix == ".jsonl" else None
            records = (
                [json.loads(line) for line in lines if line.strip()] if lines is not None else json.loads(raw)
            )
            if isinstance(records, dict):
                records = [records]
            for i, record in enumerate(records):
                if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                    raise ValueError(f"{path}: record {i} has no string 'text' field; each record needs one")
                name = str(record.get("name", f"{path.name}:{i}"))
                kind = "code" if record.get("source") == "python" else _kind_of(name)
                documents.append(Document(name, record["text"], kind))
                total += len(record["text"])
        else:
            text = path.read_text(encoding="utf-8", errors="replace")
            documents.append(Document(path.name, text, _kind_of(path.name)))
            total += len(text)
    if not documents:
        raise ValueError(f"no documents found in {[str(p) for p in paths]}; pass .txt/.md/.py/.jsonl files")
    return documents


def load_hub_documents(
    dataset_name: str,
    dataset_config_name: str | None = None,
    split: str = "test",
    text_column: str = "text",
    max_documents: int = 64,
    kind: str = "text",
) -> list[Document]:
    """The first `max_documents` rows of a `datasets` dataset (streamed: nothing else is downloaded)."""
    if not 1 <= max_documents <= 100_000:
        raise ValueError(f"max_documents must be in [1, 100000], got {max_documents}")
    try:
        import datasets
    except ImportError as error:
        raise ImportError("--dataset_name needs `datasets`: pip install 'hf-budgetdraft[train]'") from error
    stream = datasets.load_dataset(dataset_name, dataset_config_name, split=split, streaming=True)
    documents = []
    for i, row in enumerate(stream):
        if i >= max_documents:
            break
        if text_column not in row:
            raise ValueError(f"{dataset_name} has no column {text_column!r}; columns: {sorted(row)}")
        documents.append(Document(f"{dataset_name}:{split}:{i}", row[text_column], kind))
    return documents


def stdlib_documents(max_code_files: int = 40) -> list[Document]:
    """An offline corpus from the running Python: prose (the `pydoc` topic texts, or the modules' docstrings where a
    distribution strips `pydoc_data`) and code (the `max_code_files` largest standard-library modules)."""
    if not 1 <= max_code_files <= 10_000:
        raise ValueError(f"max_code_files must be in [1, 10000], got {max_code_files}")
    root = Path(sysconfig.get_paths()["stdlib"])
    sources = sorted(sorted(root.glob("*.py"), key=lambda p: (-p.stat().st_size, p.name))[:max_code_files])
    code = [Document(p.name, p.read_text(encoding="utf-8", errors="replace"), "code") for p in sources]
    try:
        from pydoc_data.topics import topics

        prose = [Document(f"pydoc:{name}", topics[name], "text") for name in sorted(topics)]
    except ImportError:
        prose = []
        for doc in code:
            try:
                docstring = ast.get_docstring(ast.parse(doc.text))
            except SyntaxError:
                docstring = None
            if docstring:
                prose.append(Document(f"docstring:{doc.name}", docstring, "text"))
    return prose + code
