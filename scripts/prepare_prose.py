"""Build an out-of-corpus English prose set for drafter training: manual pages and Python package descriptions.

The demo corpus is Shakespeare, Milton and Python sources; a drafter trained only on it has never seen the kind of
technical English users feed a model. This adds rendered manual pages (`man`, sections 1/5/7/8) and the long
descriptions of the installed Python distributions (their `METADATA` bodies), read from this machine, offline.

Held out by content: every paragraph sharing an 8-word shingle (all of them, not a sample) with a text the benchmarks
hold out is dropped: the licence texts in /usr/share/common-licenses (the out-of-corpus benchmark text), the
bundled held-out play and the corpus' eval split. Debian's `copyright` files are never read. Documents are taken in
a seeded order until `--max-bytes`.

Writes `<out>/train.jsonl` (`{"source", "name", "text"}` records, as `scripts/prepare_corpus.py` writes them) and
`<out>/manifest.json`: per document its source, name, SHA-256 of its normalised text and a 1/64 sample of its
shingles, so a test can check by content that no benchmark text leaked in.

    python scripts/prepare_prose.py --out data/prose
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import random
import subprocess
from pathlib import Path

from prepare_corpus import MANIFEST_SAMPLE, SHINGLE_WORDS, content_hash, shingles

from hf_budgetdraft.demo.documents import DEMO_TEXT, LICENCE_DIR

REPO = Path(__file__).resolve().parent.parent
# held out beside the licence texts: the bundled play and the corpus' eval split
HELD_OUT_FILES = (DEMO_TEXT, REPO / "data" / "corpus" / "eval.jsonl")
MAN_SECTIONS = ("man1", "man5", "man7", "man8")
MIN_DOCUMENT_BYTES = 2_000
# the Google Cloud SDK installs ~16,600 near-identical generated pages; they would crowd out every other page
SKIPPED_MAN_PREFIXES = ("gcloud",)


def held_out_shingles(extra: list[Path]) -> set[int]:
    """Every 8-word shingle of the texts the benchmarks hold out (licences, the held-out play, the eval split)."""
    texts = [
        p.read_text(encoding="utf-8", errors="replace") for p in sorted(LICENCE_DIR.glob("*")) if p.is_file()
    ]
    for path in extra:
        if path.suffix == ".jsonl":
            texts += [
                json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines() if line
            ]
        else:
            texts.append(path.read_text(encoding="utf-8"))
    found: set[int] = set()
    for text in texts:
        found |= shingles(text, sample=1)
    return found


def man_page(path: Path) -> str:
    """A rendered manual page as plain text (80 columns, no overstrike, lines stripped)."""
    rendered = subprocess.run(
        ["man", "--no-justification", "--no-hyphenation", "-l", str(path)],
        capture_output=True,
        text=True,
        env={**os.environ, "MANWIDTH": "80", "MAN_KEEP_FORMATTING": "0"},
        timeout=30,
    ).stdout
    plain = subprocess.run(["col", "-bx"], input=rendered, capture_output=True, text=True, timeout=30).stdout
    return "\n".join(line.strip() for line in plain.splitlines())


def candidates(seed: int) -> list[tuple[str, str, object]]:
    """`(source, name, loader)` for every manual page and package description, in a seeded order."""
    found = []
    for section in MAN_SECTIONS:
        for path in sorted(Path("/usr/share/man", section).glob("*")):
            if path.is_file() and not path.is_symlink() and not path.name.startswith(SKIPPED_MAN_PREFIXES):
                found.append(("man", f"{section}/{path.name}", lambda p=path: man_page(p)))
    for dist in sorted(importlib.metadata.distributions(), key=lambda d: d.metadata["Name"] or ""):
        body = (dist.read_text("METADATA") or "").partition("\n\n")[2]
        found.append(("pypi", f"{dist.metadata['Name']}/METADATA", lambda b=body: b))
    random.Random(seed).shuffle(found)
    return found


def clean(text: str, held_out: set[int]) -> tuple[str, int]:
    """`text` without the paragraphs that share a shingle with a held-out text, and how many were dropped."""
    kept, dropped = [], 0
    for paragraph in text.split("\n\n"):
        if not paragraph.strip():
            continue
        if shingles(paragraph, sample=1) & held_out:
            dropped += 1
        else:
            kept.append(paragraph.strip("\n"))
    return "\n\n".join(kept), dropped


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=REPO / "data" / "prose")
    parser.add_argument("--max-bytes", type=int, default=6_000_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    held_out = held_out_shingles(list(HELD_OUT_FILES))
    records, manifest, total, dropped = [], [], 0, 0
    seen_hashes = set()
    for source, name, load in candidates(args.seed):
        text, lost = clean(load(), held_out)
        digest = content_hash(text)
        if len(text) < MIN_DOCUMENT_BYTES or digest in seen_hashes:
            continue
        seen_hashes.add(digest)
        dropped += lost
        records.append({"source": source, "name": name, "text": text})
        manifest.append({"source": source, "name": name, "sha256": digest, "dropped_paragraphs": lost})
        manifest[-1]["shingles"] = sorted(shingles(text, sample=MANIFEST_SAMPLE))
        total += len(text)
        if total >= args.max_bytes:
            break
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "train.jsonl", "w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    header = {"shingle_words": SHINGLE_WORDS, "shingle_sample": MANIFEST_SAMPLE, "seed": args.seed}
    header["held_out"] = [f"{LICENCE_DIR}/*", *(str(p.relative_to(REPO)) for p in HELD_OUT_FILES)]
    with open(args.out / "manifest.json", "w", encoding="utf-8") as handle:
        json.dump({**header, "documents": manifest}, handle, separators=(",", ":"))
    sources = {s: sum(r["source"] == s for r in records) for s in ("man", "pypi")}
    print(
        f"{len(records)} documents ({sources}), {total:,} bytes, {dropped} paragraphs dropped as held-out text"
    )


if __name__ == "__main__":
    main()
