"""Helpers for the trainer tests: a character-level tokenizer for the tiny models' 128-token vocabulary, tiny
target/drafter pairs (from `tiny_models`) and small text corpora. Nothing is downloaded."""

from __future__ import annotations

import random
import string
from pathlib import Path

from tiny_models import COMMON
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

EOS = "\x03"


def char_tokenizer() -> PreTrainedTokenizerFast:
    """ASCII characters -> ids 0..127 (the tiny models' vocab_size), EOS = '\\x03'."""
    vocab = {chr(i): i for i in range(COMMON["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="?"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, unk_token="?")


def write_corpus(folder: Path, num_documents: int = 3, length: int = 700, seed: int = 0) -> Path:
    """`num_documents` text files of pseudo-words, in `folder` and a sub-folder (found recursively)."""
    rng = random.Random(seed)
    words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 7))) for _ in range(40)]
    for index in range(num_documents):
        text = " ".join(rng.choice(words) for _ in range(length // 4))[:length]
        path = folder / ("sub" if index % 2 else ".") / f"doc{index}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return folder
