"""`scripts/prepare_corpus.py`'s document split: duplicate editions never straddle train and eval.

The script itself downloads its source sdist, so its pure dedupe/split functions run here on synthetic documents
with the kinds of duplicates the sdist holds (a reformatted identical copy, a copy with an extra introduction, a
module whose docstrings are copied from another) and a licence paragraph every document carries; the split the
bundled models were trained and measured on is checked by content through the manifest the script wrote
(`tests/data/corpus_manifest.json`).
"""

import importlib.util
import json
import random

import pytest
from repo_paths import REPO, TEST_DATA

SCRIPT = REPO / "scripts" / "prepare_corpus.py"
MANIFEST = TEST_DATA / "corpus_manifest.json"
EVAL_EVERY = 3  # eval: indices 2, 5, 8, 11


@pytest.fixture(scope="module")
def corpus():
    spec = importlib.util.spec_from_file_location("prepare_corpus", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _words(rng: random.Random, count: int) -> str:
    return " ".join(f"w{rng.randrange(5000)}" for _ in range(count))


def _documents() -> tuple[list[tuple[str, str]], set[int]]:
    """Twelve documents `d00..d11` and the indices of those in no duplicate group."""
    rng = random.Random(0)
    licence = _words(rng, 60)
    a, b, c = _words(rng, 400), _words(rng, 400), _words(rng, 400)
    texts = {
        1: a,
        2: "\n\t ".join(word.upper() for word in a.split()),  # same words, other case and layout
        4: _words(rng, 150) + "\n\n" + b,  # b with an introduction (train) ...
        5: b,  # ... and without (eval)
        8: c,  # the first of its group is on the eval side, but an annotated edition is on the train side ...
        10: _words(rng, 200) + "\n" + c,  # ... so the train side keeps it and the eval side loses its copy
        11: _words(rng, 300) + " " + b[: len(b) // 4],  # eval, a quarter of it copied from a train document
        7: _words(rng, 40),  # short: mostly licence, which must not make it a duplicate of everything
    }
    unrelated = {i for i in range(12) if i not in texts or i == 7}  # (11 overlaps, but is in no group)
    for i in unrelated - {7}:
        texts[i] = _words(rng, 400)
    docs = [(f"d{i:02d}", texts[i] + "\n\n" + licence) for i in range(12)]
    return docs, unrelated


def _shingles(text: str, size: int = 8) -> set[str]:
    words = " ".join(text.lower().split()).split()
    return {" ".join(words[i : i + size]) for i in range(len(words) - size + 1)}


def test_no_eval_text_is_in_train_and_unrelated_documents_keep_their_side(corpus):
    docs, unrelated = _documents()
    train, evaluation, dropped = corpus.split_documents(docs, eval_every=EVAL_EVERY)

    # an independent check: normalised text and every (unsampled) 8-word shingle, the common licence excepted
    everywhere = set.intersection(*(_shingles(text) for _, text in docs))
    for eval_name, eval_text in evaluation:
        for train_name, train_text in train:
            assert " ".join(eval_text.lower().split()) != " ".join(train_text.lower().split())
            shared = (_shingles(eval_text) & _shingles(train_text)) - everywhere
            assert not shared, f"{eval_name} shares text with {train_name}"

    side = {name: "eval" for name, _ in evaluation} | {name: "train" for name, _ in train}
    for i in unrelated:
        assert side.get(f"d{i:02d}") == ("eval" if i % EVAL_EVERY == EVAL_EVERY - 1 else "train")
    assert sorted(name for name, _ in dropped) == ["d02", "d05", "d08", "d11"]
    assert dict(dropped)["d08"] == "a duplicate of d10" and dict(dropped)["d02"] == "a duplicate of d01"
    assert dict(dropped)["d11"].endswith("is in d04 (train)")  # b's annotated edition, kept on the train side
    assert side["d01"] == "train" and side["d04"] == "train" and side["d10"] == "train"
    for kept in (train, evaluation):  # each side in the documents' order
        assert [name for name, _ in kept] == sorted(name for name, _ in kept)
    assert len(train) + len(evaluation) == len(side) == len(docs) - len(dropped)  # each kept document once
    assert [name for name, _ in train] == [f"d{i:02d}" for i in range(12) if i % EVAL_EVERY != EVAL_EVERY - 1]


def test_no_held_out_document_shares_text_with_what_the_bundled_models_read():
    """The split on disk, by content: every eval document against every document a model trained before or after
    deduplication read (train and dropped), on the manifest's shingle samples; and the bundled play is that split's
    King John."""
    manifest = json.loads(MANIFEST.read_text())
    documents = manifest["documents"]
    held_out = [d for d in documents if d["side"] == "eval"]
    read = [d for d in documents if d["side"] != "eval"]
    assert len(held_out) == 13 and {"john_gut.txt", "coriolanus_gut.txt"} <= {d["name"] for d in held_out}
    assert "paradiselost.txt" in {d["name"] for d in read}  # the byte-identical copy of a training text
    for doc in held_out:
        sample = set(doc["shingles"])
        for other in read:
            assert doc["sha256"] != other["sha256"], f"{doc['name']} is {other['name']}"
            shared = len(sample & set(other["shingles"]))
            assert shared <= max(1, 0.02 * len(sample)), (
                f"{doc['name']} shares {shared} shingles with {other['name']}"
            )


def test_the_bundled_play_is_held_out(corpus):
    manifest = json.loads(MANIFEST.read_text())
    text = (REPO / "hf_budgetdraft" / "demo" / "king_john.txt").read_text(encoding="utf-8")
    sample = corpus.shingles(text, sample=manifest["shingle_sample"])
    sides = {d["name"]: (d["side"], set(d["shingles"])) for d in manifest["documents"]}
    assert len(sample) > 300 and sides["john_gut.txt"][0] == "eval" and sample <= sides["john_gut.txt"][1]
    shared = max(len(sample & shingles) for side, shingles in sides.values() if side != "eval")
    assert shared <= 0.02 * len(sample)  # a stock 8-word phrase or two, not a copy of the play


def test_without_duplicates_the_split_is_every_nth_document(corpus):
    rng = random.Random(1)
    docs = [(f"doc{i:02d}", _words(rng, 300)) for i in range(25)]
    train, evaluation, dropped = corpus.split_documents(docs)
    assert dropped == []
    assert evaluation == [docs[9], docs[19]]
    assert train == [doc for i, doc in enumerate(docs) if i not in (9, 19)]


def test_duplicate_groups_are_transitive(corpus):
    rng = random.Random(2)
    a, b, c = _words(rng, 300), _words(rng, 300), _words(rng, 300)
    # a and b share nothing, but an edition holding both is a duplicate of each: one group, one side
    groups = corpus.duplicate_groups([a, a + " " + b, c, b])
    assert groups == [[0, 1, 3], [2]]


def test_bad_arguments(corpus):
    with pytest.raises(ValueError, match="eval_every must be >= 2"):
        corpus.split_documents([("a", "x")], eval_every=1)
    with pytest.raises(TypeError, match="eval_every must be an int"):
        corpus.split_documents([("a", "x")], eval_every="10")
    with pytest.raises(TypeError, match=r"\(name, text\) string pairs"):
        corpus.split_documents(["just text"])
    with pytest.raises(ValueError, match="threshold must be in"):
        corpus.duplicate_groups(["x"], threshold=0)
    with pytest.raises(ValueError, match="held_out_threshold must be in"):
        corpus.split_documents([("a", "x")], held_out_threshold=0)
