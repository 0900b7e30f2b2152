"""The data of `train_far_target.py`: the corpus tokenised and held out by content, and the rows it trains on.

`prepare` tokenises `<corpus>/train.jsonl` and `<corpus>/eval.jsonl` (`scripts/prepare_corpus.py`'s split, by
document) with the bundled tokenizer and cuts out of the training documents every `SPAN`-token window that also
occurs in an evaluation document (`held_out`), so no evaluation document, nor a 64-token span of one, is trained on.
It writes `train.safetensors` / `eval.safetensors` (token streams, documents joined by EOS; int16 where the
vocabulary fits, so the training stream travels to a GPU machine in 6 MB beside the wheels) and `prepare.json`
(counts, spans cut).

`Rows` draws the training rows, `length + 1` tokens with a 0/1 score mask of `length`:
- `text`: natural text, every token scored;
- `copy`: natural text in which a passage of 32-256 tokens reappears 64 to `length` tokens after it was seen;
  scored: the reappearance after its first `COPY_CUE` tokens (it is predictable only by copying);
- `fact`: one to four facts planted in the first half in `TRAINING_FORMAT` (invented entities and values), and at
  the end a question about one of them; scored: the answer. The evaluation's formats
  (`hf_budgetdraft.eval.far_context.RETRIEVAL_FORMATS`) are never generated;
- `repeat`: tokens drawn at random from a per-row alphabet of `REPEAT_ALPHABET` tokens, themselves drawn from the
  `repeat_pool` most frequent corpus tokens, a quarter of the row written twice at a varied distance; scored: the
  second copy after its first token. Nothing but induction (find the current token earlier, copy what followed it)
  predicts it and no bigram statistics compete, so a copying head forms on it first (the training script's
  induction phase); over a pool of 64 tokens (one fixed alphabet) it forms many times faster than over the whole
  vocabulary, so the phase starts there and widens the pool.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

TOKENIZER = Path(__file__).resolve().parents[1] / "hf_budgetdraft" / "demo" / "tokenizer"  # the bundled one
SPAN = 64  # a training row never holds a window this long that occurs in an evaluation document
COPY_CUE = 8
KINDS = ("text", "copy", "fact", "repeat")
REPEAT_ALPHABET = 64
TRAINING_FORMAT = (
    " The {attribute} of {entity} is {value}.",
    "\nQuestion: what is the {attribute} of {entity}? Answer: the {attribute} of {entity} is",
)
ATTRIBUTES = ("number", "word", "seal", "token", "mark", "sign", "figure", "cipher")
SYLLABLES = (
    "ka",
    "lo",
    "mir",
    "ten",
    "vas",
    "ul",
    "dro",
    "pe",
    "qua",
    "ris",
    "sem",
    "tor",
    "ny",
    "bel",
    "fa",
    "gor",
)


def parse_mix(text: str, kinds: tuple[str, ...] = KINDS) -> list[float]:
    """Weights of `kinds` from `"4/4/2/1"`; `ValueError` unless there is one non-negative weight per kind, not all 0."""
    try:
        weights = [float(w) for w in text.split("/")]
    except ValueError:
        weights = []
    if len(weights) != len(kinds) or min(weights) < 0 or sum(weights) <= 0:
        raise ValueError(f"the mix takes {len(kinds)} non-negative weights ({'/'.join(kinds)}), got {text!r}")
    return weights


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def _windows(ids: list[int]) -> set[tuple]:
    return {tuple(ids[i : i + SPAN]) for i in range(len(ids) - SPAN + 1)}


def held_out(train_docs: list[list[int]], eval_docs: list[list[int]]) -> tuple[list[list[int]], int]:
    """Each training document with every `SPAN`-token window found in an evaluation document cut out (the document
    split around it); `(pieces, windows cut)`."""
    banned = set().union(*(_windows(doc) for doc in eval_docs)) if eval_docs else set()
    pieces, cut = [], 0
    for doc in train_docs:
        start, i = 0, 0
        while i + SPAN <= len(doc):
            if tuple(doc[i : i + SPAN]) in banned:
                if i > start:
                    pieces.append(doc[start : i + SPAN - 1])
                cut += 1
                start = (
                    i + 1
                )  # the banned window loses its first token; overlapping windows keep being checked
            i += 1
        pieces.append(doc[start:])
    return [p for p in pieces if p], cut


def prepare(tokenizer, corpus: Path, out: Path) -> dict:
    """Tokenise the corpus split, hold the evaluation side out by content, write the token streams."""
    docs = {
        side: [json.loads(line)["text"] for line in (corpus / f"{side}.jsonl").read_text().splitlines()]
        for side in ("train", "eval")
    }
    encoded = {side: [_encode(tokenizer, text) for text in texts] for side, texts in docs.items()}
    train, cut = held_out(encoded["train"], encoded["eval"])
    eos = tokenizer.eos_token_id
    dtype = torch.int16 if len(tokenizer) <= torch.iinfo(torch.int16).max + 1 else torch.int32
    out.mkdir(parents=True, exist_ok=True)
    for side, pieces in (("train", train), ("eval", encoded["eval"])):
        stream = [t for piece in pieces for t in [*piece, eos]]
        save_file({"tokens": torch.tensor(stream, dtype=dtype)}, str(out / f"{side}.safetensors"))
    summary = {
        "documents": {side: len(texts) for side, texts in docs.items()},
        "train_tokens": sum(len(p) + 1 for p in train),
        "eval_tokens": sum(len(d) + 1 for d in encoded["eval"]),
        "windows_cut": cut,
        "span": SPAN,
    }
    (out / "prepare.json").write_text(json.dumps(summary, indent=2))
    return summary


def load_tokens(data: Path, side: str) -> torch.Tensor:
    return load_file(str(data / f"{side}.safetensors"))["tokens"].long()


class Rows:
    """Draws training rows (see the module docstring) from `tokens (n,)`, seeded."""

    def __init__(self, tokenizer, tokens: torch.Tensor, seed: int):
        self.tokenizer, self.tokens, self.rng = tokenizer, tokens, random.Random(seed)
        counts = torch.bincount(tokens)
        self.by_frequency = counts.argsort(descending=True)[: int((counts > 0).sum())].tolist()
        self.repeat_pool = len(self.by_frequency)  # the induction phase narrows it, then widens it again

    def natural_text(self, length: int) -> list[int]:
        """`length` consecutive tokens of the stream from a random place."""
        start = self.rng.randrange(0, self.tokens.numel() - length)
        return self.tokens[start : start + length].tolist()

    def _word(self, syllables: int) -> str:
        return "".join(self.rng.choice(SYLLABLES) for _ in range(syllables)).capitalize()

    def sample(self, length: int, kind: str) -> tuple[list[int], list[int]]:
        """`(ids (length + 1), mask (length))` of a row of `kind`."""
        total = length + 1
        if kind == "text":
            return self.natural_text(total), [1] * length
        if kind == "copy":
            return self._copy(total)
        if kind == "repeat":
            return self._repeat(total)
        return self._fact(total)

    def _copy(self, total: int) -> tuple[list[int], list[int]]:
        ids = self.natural_text(total)
        gap = min(64, total // 8)  # the shortest distance between the passage and its reappearance
        span = self.rng.randint(min(32, total // 8), max(min(256, total // 4), min(32, total // 8)))
        source = self.rng.randrange(0, total - 2 * span - gap)
        repeat = self.rng.randrange(source + span + gap, total - span + 1)
        ids[repeat : repeat + span] = ids[source : source + span]
        mask = [0] * (total - 1)
        for position in range(repeat + COPY_CUE, repeat + span):
            mask[position - 1] = 1  # the prediction of token `position`, made at `position - 1`
        return ids, mask

    def _repeat(self, total: int) -> tuple[list[int], list[int]]:
        pool = self.by_frequency[: max(REPEAT_ALPHABET, self.repeat_pool)]
        alphabet = self.rng.sample(pool, min(REPEAT_ALPHABET, len(pool)))
        ids = [self.rng.choice(alphabet) for _ in range(total)]
        span = max(2, total // 4)
        source = self.rng.randrange(0, total // 2 - span + 1)
        repeat = self.rng.randrange(source + span + 1, total - span + 1)
        ids[repeat : repeat + span] = ids[source : source + span]
        mask = [0] * (total - 1)
        for position in range(repeat + 1, repeat + span):
            mask[position - 1] = 1
        return ids, mask

    def facts(self) -> tuple[list[list[int]], list[int], list[int]]:
        """`(needles, question, answer)`: one to four facts in `TRAINING_FORMAT` about invented entities (ids of
        each statement), a question about one of them and its answer."""
        facts = []
        for _ in range(self.rng.randint(1, 4)):
            value = (
                "".join(self.rng.choice("0123456789") for _ in range(self.rng.randint(4, 7)))
                if self.rng.random() < 0.5
                else self._word(self.rng.randint(2, 3))
            )
            facts.append((self.rng.choice(ATTRIBUTES), f"{self._word(2)} {self._word(2)}", value))
        attribute, entity, value = self.rng.choice(facts)
        needles = [
            _encode(self.tokenizer, TRAINING_FORMAT[0].format(attribute=a, entity=e, value=v))
            for a, e, v in facts
        ]
        question = _encode(self.tokenizer, TRAINING_FORMAT[1].format(attribute=attribute, entity=entity))
        return needles, question, _encode(self.tokenizer, " " + value)

    def haystack(self, length: int, needles: list[list[int]]) -> list[int]:
        """`length` tokens of natural text with each needle planted in its first half, each at its own place."""
        ids = self.natural_text(length)
        for needle in needles:
            at = self.rng.randrange(0, max(1, len(ids) // 2 - len(needle)))
            ids[at:at] = needle
        return ids[:length]

    def _fact(self, total: int) -> tuple[list[int], list[int]]:
        needles, question, answer = self.facts()
        ids = self.haystack(total - len(question) - len(answer), needles) + question + answer
        mask = [0] * (total - 1 - len(answer)) + [1] * len(answer)
        return ids, mask

    def batch(
        self, rows: int, length: int, weights: list[float]
    ) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
        """`(ids (rows, length + 1), mask (rows, length), kinds)`."""
        kinds = self.rng.choices(KINDS, weights=weights, k=rows)
        drawn = [self.sample(length, kind) for kind in kinds]
        ids = torch.tensor([d[0] for d in drawn])
        mask = torch.tensor([d[1] for d in drawn], dtype=torch.float32)
        return ids, mask, kinds
