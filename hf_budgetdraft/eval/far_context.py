"""Far-context probes: does a target use what it read thousands of tokens back?

Two kinds, each built on held-out filler text and scored teacher-forced (one forward per probe, the target's argmax
at every scored position):

- **copy** (`copy_probe`): a passage seen once, `distance` tokens of filler, then the passage again; after its first
  `cue` tokens the second copy is predictable only by copying. Score: per-token agreement with the passage.
- **retrieval** (`retrieval_probe`): a fact stated once, `distance` tokens of filler, then a question whose answer
  prefix echoes the fact. Score: 1 if every answer token is the target's argmax, else 0. The formats
  (`RETRIEVAL_FORMATS`: a code worded otherwise than the trained passkey, a person's name, a number inside prose)
  are never the passkey format the bundled targets train on (`demo/tasks.py`'s `NEEDLE`), so a target that scores
  here retrieves, rather than recognising one trained format.

An induction oracle (copy the token that followed the longest earlier match of the current suffix) scores 100% on
both; a target that reads nothing far back scores at chance.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from ..demo.documents import DEMO_TEXT, licence_text

# (needle, question ending in the echoed answer prefix, values) — kept apart from the training passkey's wording
RETRIEVAL_FORMATS = {
    "code_word": (
        " A note for later: the access code for the east archive is {value}.",
        "\nQuestion: what is the access code for the east archive? Answer: the access code for the east archive is",
        "digits",
    ),
    "name": (
        " In those years the keeper of the northern lighthouse was a man called {value}.",
        "\nQuestion: who kept the northern lighthouse? Answer: the keeper of the northern lighthouse was a man called",
        "names",
    ),
    "number_in_prose": (
        " By the end of that winter the granary held exactly {value} sacks of barley, or so the steward wrote.",
        "\nQuestion: how many sacks did the granary hold? Answer: the granary held exactly",
        "number",
    ),
}
FIRST_NAMES = (
    "Aldous",
    "Brenna",
    "Caspar",
    "Delphine",
    "Evander",
    "Fenella",
    "Gideon",
    "Hollis",
    "Isolde",
    "Jasper",
)
LAST_NAMES = ("Marrow", "Quillfeather", "Ashdown", "Penhallow", "Thistlewood", "Carrick", "Vane", "Oakhurst")


@dataclass
class FarProbe:
    """One probe: `input_ids (1, L)`; `scored (n,)` positions whose token the target must predict from the one
    before; `kind` and `distance` (filler tokens between the first sight and the reuse)."""

    kind: str
    distance: int
    input_ids: torch.LongTensor
    scored: torch.LongTensor


def held_out_sources(tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """`(filler (n,), passages (m,))`: token ids of held-out text for the probes: the bundled King John as filler,
    the licence texts found on this machine as passages (King John's last 20,000 characters where none is)."""
    play = DEMO_TEXT.read_text(encoding="utf-8")
    filler = tokenizer(play, return_tensors="pt").input_ids[0]
    return filler, tokenizer(licence_text() or play[-20000:], return_tensors="pt").input_ids[0]


def _filler(filler_ids: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """`length` tokens of `filler_ids (n,)` from `start`, cycled."""
    reps = (start + length) // max(filler_ids.numel(), 1) + 1
    return filler_ids.repeat(reps)[start : start + length]


def copy_probe(
    filler_ids: torch.Tensor, passage_ids: torch.Tensor, distance: int, cue: int = 32, lead: int = 64
) -> FarProbe:
    """`lead` filler tokens, the passage, `distance` filler tokens, the passage again; scored: the second copy
    after its first `cue` tokens."""
    if not 0 <= cue < passage_ids.numel() - 1 or distance < 0:
        raise ValueError(
            f"need 0 <= cue < len(passage) - 1 and distance >= 0, got cue={cue}, distance={distance}"
        )
    head = _filler(filler_ids, 0, lead)
    middle = _filler(filler_ids, lead, distance)
    ids = torch.cat([head, passage_ids, middle, passage_ids])
    start = lead + passage_ids.numel() + distance
    return FarProbe("copy", distance, ids[None], torch.arange(start + cue, ids.numel()))


def _value(kind: str, rng: random.Random) -> str:
    if kind == "digits":
        return "".join(rng.choice("0123456789") for _ in range(6))
    if kind == "names":
        return f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}"
    return str(rng.randrange(1000, 10000))


def retrieval_probe(
    tokenizer, filler_ids: torch.Tensor, name: str, distance: int, seed: int = 0, lead: int = 64
):
    """A fact in format `name` (`RETRIEVAL_FORMATS`), `distance` filler tokens, the question; scored: the answer."""
    if name not in RETRIEVAL_FORMATS:
        raise ValueError(f"name must be one of {sorted(RETRIEVAL_FORMATS)}, got {name!r}")
    needle, question, values = RETRIEVAL_FORMATS[name]
    value = _value(values, random.Random(seed))

    def encode(text: str) -> torch.Tensor:
        return torch.tensor(tokenizer(text, add_special_tokens=False).input_ids, dtype=torch.long)

    head, middle = _filler(filler_ids, 0, lead), _filler(filler_ids, lead, distance)
    answer = encode(" " + value)
    ids = torch.cat([head, encode(needle.format(value=value)), middle, encode(question), answer])
    return FarProbe(name, distance, ids[None], torch.arange(ids.numel() - answer.numel(), ids.numel()))


@torch.inference_mode()
def score(model, probe: FarProbe) -> float:
    """Copy: the share of scored tokens that are the model's argmax; retrieval: 1.0 if all of them are, else 0.0."""
    weights = next(model.parameters(), None)
    ids = probe.input_ids.to(weights.device if weights is not None else "cpu")
    device = ids.device
    logits = model(input_ids=ids).logits[0]  # (L, V)
    predicted = logits[probe.scored.to(device) - 1].argmax(-1)
    hits = (predicted == ids[0, probe.scored.to(device)]).float()
    return float(hits.mean()) if probe.kind == "copy" else float(hits.all())


class InductionOracle(torch.nn.Module):
    """A reference "model" that reads far context perfectly by induction: at each position it predicts the token
    that followed the longest earlier match (up to `longest` tokens) of the current suffix (uniform logits where
    nothing matches). Scores 100% on every probe here; for the tests."""

    def __init__(self, vocab_size: int, longest: int = 64):
        super().__init__()
        self.vocab_size, self.longest = vocab_size, longest

    def forward(self, input_ids: torch.LongTensor):
        ids = input_ids[0].tolist()
        logits = torch.zeros(1, len(ids), self.vocab_size)
        last_seen: dict[tuple, int] = {}
        for t in range(len(ids)):
            for k in range(
                1, min(self.longest, t) + 1
            ):  # the suffixes ending at t - 1, now followed by ids[t]
                last_seen[tuple(ids[t - k : t])] = t - 1
            for k in range(min(self.longest, t + 1), 0, -1):
                earlier = last_seen.get(tuple(ids[t - k + 1 : t + 1]))
                if earlier is not None and earlier < t:
                    logits[0, t, ids[earlier + 1]] = 1.0
                    break
        return _Output(logits)


@dataclass
class _Output:
    logits: torch.Tensor
