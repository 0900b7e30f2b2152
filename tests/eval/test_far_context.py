"""`eval/far_context.py`: the far-context probes score what they claim — an induction oracle (which reads far back
perfectly) scores 100%, a model that reads nothing scores at chance — and their formats are not the trained one."""

import pytest
import torch
from transformers import AutoTokenizer

from hf_budgetdraft.demo import tasks
from hf_budgetdraft.demo.documents import DEMO_TEXT
from hf_budgetdraft.demo.models import DEMO_DIR
from hf_budgetdraft.eval.far_context import (
    RETRIEVAL_FORMATS,
    InductionOracle,
    copy_probe,
    retrieval_probe,
    score,
)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEMO_DIR / "tokenizer", local_files_only=True)


@pytest.fixture(scope="module")
def filler(tokenizer):
    text = DEMO_TEXT.read_text(encoding="utf-8")[:20000]
    return torch.tensor(tokenizer(text, add_special_tokens=False).input_ids)


class Blind(torch.nn.Module):
    """Reads nothing: the same random logits whatever came before."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.randn(vocab_size, generator=torch.Generator().manual_seed(0)))

    def forward(self, input_ids):
        return type("Out", (), {"logits": self.bias.expand(1, input_ids.shape[1], -1)})()


def test_the_oracle_scores_everything_and_a_blind_model_scores_at_chance(tokenizer, filler):
    vocab = len(tokenizer)
    oracle, blind = InductionOracle(vocab, longest=24), Blind(vocab)
    generator = torch.Generator().manual_seed(1)
    passage = torch.randint(0, vocab, (96,), generator=generator)  # random tokens: copying is the only way
    probe = copy_probe(filler, passage, distance=400, cue=16)
    assert probe.input_ids.shape[1] == 64 + 96 + 400 + 96 and len(probe.scored) == 96 - 16
    assert score(oracle, probe) == 1.0 and score(blind, probe) <= 3 / 96
    for name in RETRIEVAL_FORMATS:
        for seed in range(3):
            probe = retrieval_probe(tokenizer, filler, name, distance=300, seed=seed)
            assert score(oracle, probe) == 1.0, (name, seed)
            assert score(blind, probe) == 0.0


def test_the_formats_are_never_the_trained_passkey(tokenizer, filler):
    trained = (tasks.NEEDLE.split("{")[0].strip().lower(), tasks.QUESTION.strip().lower())
    for needle, question, _ in RETRIEVAL_FORMATS.values():
        assert all(part not in (needle + question).lower() for part in trained)
    probe = retrieval_probe(tokenizer, filler, "name", distance=50, seed=4)
    text = tokenizer.decode(probe.input_ids[0])
    answer = tokenizer.decode(probe.input_ids[0, probe.scored])
    assert text.count(answer.strip()) == 2 and "lighthouse" in text  # stated once, answered once


def test_bad_probes_are_refused(tokenizer, filler):
    with pytest.raises(ValueError, match="cue"):
        copy_probe(filler, filler[:10], distance=5, cue=10)
    with pytest.raises(ValueError, match="name must be one of"):
        retrieval_probe(tokenizer, filler, "passkey", distance=5)
