"""The long documents the demo models are evaluated on (bench `--preset demo`, the app's built-in contexts, the
out-of-corpus prose of the benchmarks)."""

from __future__ import annotations

from pathlib import Path

from .corpus import Document, load_documents, stdlib_documents

DEMO_TEXT = Path(__file__).resolve().parent / "king_john.txt"  # bundled: a play of the held-out split
# the held-out split written by scripts/prepare_corpus.py (not in the wheel): in the working directory, then in
# the source checkout
HELD_OUT_CANDIDATES = (
    Path("data/corpus/eval.jsonl"),
    Path(__file__).resolve().parents[2] / "data" / "corpus" / "eval.jsonl",
)


# English prose outside the training corpus (no bundled model read it: checked by content when their training prose
# is prepared): the licence texts Debian ships, in this order
LICENCE_DIR = Path("/usr/share/common-licenses")
LICENCES = ("GPL-3", "GFDL-1.3", "LGPL-2.1", "GPL-2", "MPL-2.0", "Apache-2.0", "Artistic", "LGPL-3")


def licence_text() -> str:
    """The licence texts of `LICENCE_DIR` found on this machine, joined by blank lines ("" where none is)."""
    found = [LICENCE_DIR / name for name in LICENCES]
    return "\n\n".join(p.read_text(encoding="utf-8") for p in found if p.is_file())


def demo_documents() -> tuple[list[Document], str]:
    """`(documents, where they came from)`: the demo corpus's held-out split when prepared, else the bundled
    King John (prose, held out) plus the Python standard library's largest modules (code)."""
    held_out = next((p for p in HELD_OUT_CANDIDATES if p.is_file()), None)
    if held_out is not None:
        return load_documents([held_out]), f"the demo corpus's held-out split ({held_out})"
    play = Document("king_john", DEMO_TEXT.read_text(encoding="utf-8"), "text")
    code = [doc for doc in stdlib_documents() if doc.kind == "code"]
    return [play, *code], "bundled King John (held out) + Python standard library sources"
