"""`scripts/prepare_prose.py`: the out-of-corpus prose the drafters train on holds none of the benchmark's held-out
text, checked by content (the script's paragraph filter on synthetic text, and the manifest it wrote for the
bundled drafters, `tests/data/prose_manifest.json`, against the licence texts and the held-out play)."""

import json
import random

import pytest
from repo_paths import TEST_DATA

from hf_budgetdraft.demo.documents import DEMO_TEXT, LICENCE_DIR

MANIFEST = TEST_DATA / "prose_manifest.json"


@pytest.fixture(scope="module")
def prose():
    import prepare_prose  # scripts/ is on the tests' path (pyproject's pytest settings)

    return prepare_prose


def _words(rng: random.Random, count: int) -> str:
    return " ".join(f"w{rng.randrange(5000)}" for _ in range(count))


def test_paragraphs_sharing_held_out_text_are_dropped(prose):
    rng = random.Random(0)
    held_out_text = _words(rng, 200)
    mine, other = _words(rng, 80), _words(rng, 80)
    quoted = " ".join(held_out_text.split()[50:58]).upper()  # eight held-out words, other case: still a match
    text = f"{mine}\n\n{other} {quoted} tail\n\n\n\n{mine[::-1]}"
    held_out = prose.shingles(held_out_text, sample=1)
    kept, dropped = prose.clean(text, held_out)
    assert dropped == 1
    assert kept == f"{mine}\n\n{mine[::-1]}"
    seven = " ".join(held_out_text.split()[50:57])  # seven words are not a shingle: kept
    assert prose.clean(f"{other} {seven}", held_out) == (f"{other} {seven}", 0)


def test_the_bundled_drafters_prose_shares_nothing_with_the_held_out_texts(prose):
    manifest = json.loads(MANIFEST.read_text())
    documents = manifest["documents"]
    sample = manifest["shingle_sample"]
    assert len(documents) > 300 and {d["source"] for d in documents} == {"man", "pypi"}
    assert not any(d["name"].startswith("man1/gcloud") for d in documents)
    assert len({d["sha256"] for d in documents}) == len(documents)
    held_out = [DEMO_TEXT.read_text(encoding="utf-8")]
    if LICENCE_DIR.is_dir():  # the benchmark's out-of-corpus text, where this machine ships it
        held_out += [
            p.read_text(encoding="utf-8", errors="replace") for p in LICENCE_DIR.glob("*") if p.is_file()
        ]
    shingles = set().union(*(prose.shingles(text, sample=sample) for text in held_out))
    assert len(shingles) > 300
    for doc in documents:
        assert not shingles & set(doc["shingles"]), f"{doc['name']} shares text with a held-out text"
