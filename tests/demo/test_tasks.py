"""Seeded task builders: exact prompt lengths, determinism, true continuations, and the needle geometry."""

import functools
import json

import pytest
import torch
from transformers import AutoTokenizer

from hf_budgetdraft.demo.corpus import Document, load_documents, stdlib_documents
from hf_budgetdraft.demo.tasks import (
    build_sample,
    code_completion_sample,
    continuation_sample,
    needle_outside_window_sample,
    passkey_sample,
)
from hf_budgetdraft.eval.bench_models import TOKENIZER_DIR

NEW = 16


@functools.cache
def tokenizer():
    return AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))


@functools.cache
def corpus():
    return stdlib_documents(max_code_files=8)


def encode(text):
    return tokenizer()(text, add_special_tokens=False).input_ids


def same(a, b):
    return (
        a.task == b.task
        and torch.equal(a.input_ids, b.input_ids)
        and torch.equal(a.reference_ids, b.reference_ids)
        and a.meta == b.meta
    )


@pytest.mark.parametrize("context", [64, 300, 2048])
def test_continuation_is_a_true_window_of_the_corpus(context):
    sample = continuation_sample(tokenizer(), corpus(), context, NEW, seed=5)
    assert sample.input_ids.shape == (1, context) and sample.reference_ids.shape == (1, NEW)
    assert same(sample, continuation_sample(tokenizer(), corpus(), context, NEW, seed=5))  # deterministic
    assert not torch.equal(
        continuation_sample(tokenizer(), corpus(), context, NEW, seed=6).input_ids, sample.input_ids
    )
    # prompt + reference are consecutive tokens of the (possibly concatenated) documents
    docs = {d.name: d.text for d in corpus()}
    text = "\n\n".join(docs[name] for name in sample.meta["documents"])
    ids, offset = encode(text), sample.meta["offset"]
    assert (
        ids[offset : offset + context + NEW]
        == sample.input_ids[0].tolist() + sample.reference_ids[0].tolist()
    )


def test_short_documents_are_concatenated():
    docs = [Document(f"d{i}", f"Short document number {i}. " * 3) for i in range(40)]
    sample = continuation_sample(tokenizer(), docs, 200, NEW, seed=0)
    assert sample.input_ids.shape == (1, 200) and len(sample.meta["documents"]) > 1


def test_code_completion_starts_at_a_line():
    sample = code_completion_sample(tokenizer(), corpus(), 512, NEW, seed=2)
    assert sample.task == "code"
    assert sample.input_ids.shape == (1, 512) and sample.reference_ids.shape == (1, NEW)
    assert tokenizer().decode(sample.input_ids[0]).endswith("\n")  # the prompt stops at a line end
    assert "line" in sample.meta and sample.meta["files"][0].endswith(".py")
    assert same(sample, code_completion_sample(tokenizer(), corpus(), 512, NEW, seed=2))
    with pytest.raises(ValueError, match="no 'code' documents"):
        code_completion_sample(tokenizer(), [Document("a", "prose " * 500)], 64, NEW)


@pytest.mark.parametrize("context,sink,window", [(256, 4, 92), (1000, 64, 512), (4096, 16, 1024)])
def test_needle_sits_just_outside_the_window_and_not_in_the_sink(context, sink, window):
    sample = needle_outside_window_sample(tokenizer(), context, sink, window, seed=1, margin=4)
    needle = encode(f" The pass key is {sample.key}. Remember it. {sample.key} is the pass key.")
    start = sample.needle_position
    assert sample.input_ids.shape == (1, context)
    assert sample.input_ids[0, start : start + len(needle)].tolist() == needle
    assert start >= sink  # not in the sink
    assert start + len(needle) == context - window - 4  # ends `margin` tokens before the window starts
    # neither the sink nor the window shows the key: only the target's full cache can answer
    assert sample.key not in tokenizer().decode(sample.input_ids[0, context - window :])
    assert sample.key not in tokenizer().decode(sample.input_ids[0, :sink])
    assert tokenizer().decode(sample.answer_ids[0]).strip() == sample.key
    with pytest.raises(ValueError, match="cannot hold a needle outside a window"):
        needle_outside_window_sample(tokenizer(), 64, sink, 60)


def test_passkey_depth_and_errors():
    deep = passkey_sample(tokenizer(), 400, depth=0.9, seed=3)
    shallow = passkey_sample(tokenizer(), 400, depth=0.1, seed=3)
    assert deep.key == shallow.key and deep.needle_position > shallow.needle_position
    assert deep.input_ids.shape == (1, 400)
    # unchanged from the version scripts/train_target.py was written against (seed 7: key and depth)
    legacy = passkey_sample(tokenizer(), 300, seed=7)
    assert (legacy.key, legacy.needle_position) == ("52601", 224)
    with pytest.raises(ValueError, match="depth must be in"):
        passkey_sample(tokenizer(), 400, depth=1.5)
    with pytest.raises(ValueError, match="too short for a passkey prompt"):
        passkey_sample(tokenizer(), 20)


def test_build_sample_dispatch():
    for task in ("document", "code", "passkey", "needle_outside_window"):
        sample = build_sample(task, tokenizer(), corpus(), 256, NEW, num_sink_tokens=4, window_length=92)
        assert sample.task == task and sample.input_ids.shape == (1, 256)
    with pytest.raises(ValueError, match="unknown task"):
        build_sample("summarise", tokenizer(), corpus(), 256, NEW)
    with pytest.raises(ValueError, match="needs a corpus"):
        build_sample("document", tokenizer(), [], 256, NEW)
    with pytest.raises(ValueError, match="context_length must be in"):
        build_sample("document", tokenizer(), corpus(), 0, NEW)


def test_load_documents(tmp_path):
    (tmp_path / "book.txt").write_text("Call me Ishmael. " * 10)
    (tmp_path / "mod.py").write_text("def f():\n    return 1\n")
    (tmp_path / "corpus.jsonl").write_text(
        json.dumps({"source": "python", "name": "x.py", "text": "x = 1\n"})
        + "\n"
        + json.dumps({"source": "gutenberg", "name": "hamlet.txt", "text": "To be"})
        + "\n"
    )
    docs = {d.name: d.kind for d in load_documents([tmp_path])}
    assert docs == {"book.txt": "text", "mod.py": "code", "x.py": "code", "hamlet.txt": "text"}
    with pytest.raises(ValueError, match="does not exist"):
        load_documents([tmp_path / "missing.txt"])
    (tmp_path / "bad.jsonl").write_text(json.dumps({"body": "no text field"}) + "\n")
    with pytest.raises(ValueError, match="no string 'text' field"):
        load_documents([tmp_path / "bad.jsonl"])
    with pytest.raises(ValueError, match="max_bytes must be in"):
        load_documents([tmp_path], max_bytes=0)
