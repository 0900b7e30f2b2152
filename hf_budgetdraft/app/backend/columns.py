"""An output column of the page: the text of each generated token and where it came from — `"ar"` (plain AR),
`"draft"` (an accepted draft token) or `"target"` (the target's own: a correction or a bonus token)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SideView:
    """One output column: the token pieces and where each token came from (`"ar"`, `"draft"`, `"target"`)."""

    title: str
    pieces: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    origins: list[str] = field(default_factory=list)
    running: bool = False
    note: str = ""


def token_origins(accepted_per_round: list[int], num_tokens: int) -> list[str]:
    """`"draft"` or `"target"` for each generated token, from the per-round accepted counts.

    Round r emits its `a_r` accepted draft tokens, then one token of the target's own: the correction at the first
    rejected draft, or the bonus token after a fully accepted draft. A round cut short by `max_new_tokens` or EOS
    is recorded with the drafts it kept (transformers recounts them), so the counts add up to the output.

    Args:
        accepted_per_round (`list[int]`): `SpeculationStats.accepted_per_round`.
        num_tokens (`int`): generated tokens (the result is cut or padded with `"target"` to this length).
    """
    origins: list[str] = []
    for accepted in accepted_per_round:
        origins += ["draft"] * int(accepted) + ["target"]
    return (origins + ["target"] * max(0, num_tokens - len(origins)))[:num_tokens]


def chunk_origins(chunk_sizes: list[int]) -> list[str]:
    """The same labels read off the streamed chunks (one chunk per round) while the run is still going."""
    return [origin for size in chunk_sizes for origin in ["draft"] * (size - 1) + ["target"]]


class IncrementalDecoder:
    """Text of each generated token such that the pieces concatenate to `tokenizer.decode(all_ids)`.

    Byte-level tokenizers split multi-byte characters over several tokens: such a token gets the empty string and
    the token that completes the character gets all of it (no stray replacement characters).
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.pieces: list[str] = []
        self._text = ""
        self._pending = 0  # tokens whose text is not complete yet

    def extend(self, ids: list[int], final: bool = False) -> list[str]:
        for token in ids:
            self.ids.append(token)
            self.pieces.append("")
            text = self.tokenizer.decode(self.ids)
            if text.endswith("\ufffd") and not final:
                self._pending += 1
                continue
            common = len(self._text) if text.startswith(self._text) else 0
            self.pieces[-1] = text[common:]
            self._text, self._pending = text, 0
        if final and self._pending:
            text = self.tokenizer.decode(self.ids)
            self.pieces[-1] += text[len(self._text) :] if text.startswith(self._text) else ""
            self._text, self._pending = text, 0
        return self.pieces
