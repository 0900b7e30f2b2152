"""The far-context scripts' shared fixtures: the demo tokenizer and a tiny corpus with a held-out quote."""

import json

import pytest
from transformers import AutoTokenizer

from hf_budgetdraft.demo.documents import DEMO_TEXT
from hf_budgetdraft.demo.models import DEMO_DIR


@pytest.fixture(scope="session")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEMO_DIR / "tokenizer", local_files_only=True)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """Five training documents and two evaluation documents; the first evaluation document quotes a 400-character
    passage of the third training document."""
    text = DEMO_TEXT.read_text(encoding="utf-8")
    chunks = [text[i * 6000 : (i + 1) * 6000] for i in range(7)]
    quoted = chunks[2][1000:1400]
    train, held = chunks[:5], [chunks[5][:3000] + quoted + chunks[5][3000:], chunks[6]]
    folder = tmp_path_factory.mktemp("corpus")
    for side, docs in (("train", train), ("eval", held)):
        lines = [json.dumps({"source": "test", "name": f"{side}{i}", "text": d}) for i, d in enumerate(docs)]
        (folder / f"{side}.jsonl").write_text("\n".join(lines) + "\n")
    return folder
