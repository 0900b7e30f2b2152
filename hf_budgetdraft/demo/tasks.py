"""Seeded long-context task builders: long-document continuation, code completion, passkey/needle retrieval.

Every builder returns a prompt of exactly `context_length` tokens and is deterministic given its `seed`:
- `continuation_sample`: a window of a long document (PG-19 style, BudgetDraft's main setting) and the real text
  that follows it;
- `code_completion_sample`: the head of a long source file (several files of the corpus concatenated when one is
  too short, as repository-level completion), cut at a line start, and the lines that follow;
- `passkey_sample`: passkey retrieval after Mohtashami & Jaggi, "Landmark Attention", arXiv 2305.16300: a pass
  key hidden at a given depth of a long filler (the classic repeated sentences, or real text as the haystack),
  then asked for at the end;
- `needle_outside_window_sample`: the same needle placed *just outside* a draft's sink + window and not in its
  sink — the case that can break windowed drafting (Windowed-MTP's missing falsifier, arXiv 2607.21535).

The corpora they read are lists of `hf_budgetdraft.demo.corpus.Document`s.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from .corpus import Document

INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there.\n"
)
FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "\nWhat is the pass key? The pass key is"

TASKS = ("document", "code", "passkey", "needle_outside_window")
_MAX_DRAWS = 32  # attempts to find a line-start cut before falling back to a token cut


@dataclass
class TaskSample:
    """A prompt and what a correct model would continue it with.

    Attributes:
        task (`str`): one of `TASKS`.
        input_ids (`torch.LongTensor` of shape `(1, context_length)`): the prompt.
        reference_ids (`torch.LongTensor` of shape `(1, n)`): the corpus continuation (document/code) or the pass
            key's tokens (passkey tasks).
        meta (`dict`): where the sample came from (document name, offset, needle position, key, ...).
    """

    task: str
    input_ids: torch.LongTensor
    reference_ids: torch.LongTensor
    meta: dict = field(default_factory=dict)


@dataclass
class PasskeySample:
    input_ids: torch.LongTensor  # (1, context_length): the prompt, ending with the question
    answer_ids: torch.LongTensor  # (1, n): the key's tokens (with its leading space)
    key: str
    needle_position: int  # token index where the needle sentence starts


# ---------------------------------------------------------------------------------------------------------------
# Long-document continuation and code completion
# ---------------------------------------------------------------------------------------------------------------


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def _long_token_stream(
    tokenizer, documents: list[Document], kind: str, needed: int, rng: random.Random, separator: str
) -> tuple[str, list[int], list[str]]:
    """A text of >= `needed` tokens: one document of `kind` if one is long enough (tried in seeded order), else
    documents of `kind` concatenated in seeded order with `separator` (formatted with the next one's name)."""
    pool = [d for d in documents if d.kind == kind]
    if not pool:
        raise ValueError(
            f"the corpus has no {kind!r} documents; pass data with {'source files' if kind == 'code' else 'prose'}"
        )
    order = rng.sample(range(len(pool)), len(pool))
    for index in order:  # a single long document, when there is one
        doc = pool[index]
        if len(doc.text) >= needed:  # >= 1 character per token: cheap filter before tokenizing
            ids = _encode(tokenizer, doc.text)
            if len(ids) >= needed:
                return doc.text, ids, [doc.name]
    text, names = "", []
    for index in order * (needed // max(1, sum(len(pool[i].text) for i in order)) + 2):
        doc = pool[index]
        text += (separator.format(name=doc.name) if text else "") + doc.text
        names.append(doc.name)
        if len(text) >= needed:
            ids = _encode(tokenizer, text)
            if len(ids) >= needed:
                return text, ids, names
    raise ValueError(f"the {kind!r} corpus holds fewer than {needed} tokens even concatenated; add data")


def _check_lengths(context_length: int, new_tokens: int) -> None:
    if not 1 <= context_length <= 1 << 22:
        raise ValueError(f"context_length must be in [1, {1 << 22}], got {context_length}")
    if not 1 <= new_tokens <= 1 << 16:
        raise ValueError(f"new_tokens must be in [1, {1 << 16}], got {new_tokens}")


def continuation_sample(
    tokenizer, documents: list[Document], context_length: int, new_tokens: int, seed: int = 0
) -> TaskSample:
    """Long-document continuation: `context_length` tokens of a prose document and the `new_tokens` after them.

    Picks (seeded) a document long enough, or concatenates documents, then a random window inside it.

    Args:
        tokenizer: the models' tokenizer.
        documents (`list[Document]`): the corpus; only `kind == "text"` documents are used.
        context_length (`int`): prompt length in tokens.
        new_tokens (`int`): length of the reference continuation.
        seed (`int`): picks the document and the window.
    """
    _check_lengths(context_length, new_tokens)
    rng = random.Random(seed)
    needed = context_length + new_tokens
    _, ids, names = _long_token_stream(tokenizer, documents, "text", needed, rng, "\n\n")
    offset = rng.randrange(0, len(ids) - needed + 1)
    window = ids[offset : offset + needed]
    return TaskSample(
        task="document",
        input_ids=torch.tensor([window[:context_length]]),
        reference_ids=torch.tensor([window[context_length:]]),
        meta={"documents": names, "offset": offset},
    )


def code_completion_sample(
    tokenizer, documents: list[Document], context_length: int, new_tokens: int, seed: int = 0
) -> TaskSample:
    """Code completion over long source files: the `context_length` tokens before a line start, and the
    `new_tokens` that follow it. Files shorter than the context are concatenated (each announced by a
    `# ---- file: NAME ----` line), as repository-level completion does.

    Args:
        tokenizer: the models' tokenizer.
        documents (`list[Document]`): the corpus; only `kind == "code"` documents are used.
        context_length (`int`): prompt length in tokens.
        new_tokens (`int`): length of the reference completion.
        seed (`int`): picks the file(s) and the line.
    """
    _check_lengths(context_length, new_tokens)
    rng = random.Random(seed)
    needed = context_length + new_tokens
    text, ids, names = _long_token_stream(
        tokenizer, documents, "code", needed + 64, rng, "\n\n# ---- file: {name} ----\n"
    )
    chars_per_token = len(text) / len(ids)
    low, high = (
        (context_length + 16) * chars_per_token * 1.1,
        len(text) - (new_tokens + 16) * chars_per_token * 1.1,
    )
    line_starts = [i + 1 for i, ch in enumerate(text) if ch == "\n" and low <= i + 1 <= high]
    for _ in range(_MAX_DRAWS if line_starts else 0):
        cut = rng.choice(line_starts)
        prefix, suffix = _encode(tokenizer, text[:cut]), _encode(tokenizer, text[cut:])
        if len(prefix) >= context_length and len(suffix) >= new_tokens:
            return TaskSample(
                task="code",
                input_ids=torch.tensor([prefix[-context_length:]]),
                reference_ids=torch.tensor([suffix[:new_tokens]]),
                meta={"files": names, "line": text.count("\n", 0, cut) + 1},
            )
    offset = rng.randrange(0, len(ids) - needed + 1)  # no usable line start (e.g. minified code): token cut
    return TaskSample(
        task="code",
        input_ids=torch.tensor([ids[offset : offset + context_length]]),
        reference_ids=torch.tensor([ids[offset + context_length : offset + needed]]),
        meta={"files": names, "offset": offset},
    )


# ---------------------------------------------------------------------------------------------------------------
# Passkey / needle retrieval
# ---------------------------------------------------------------------------------------------------------------


def _passkey_parts(
    tokenizer, rng: random.Random, digits: int
) -> tuple[str, list[int], list[int], list[int], list[int]]:
    if not 1 <= digits <= 64:
        raise ValueError(f"digits must be in [1, 64], got {digits}")
    key = "".join(rng.choice("0123456789") for _ in range(digits))
    intro = _encode(tokenizer, INTRO)
    needle = _encode(tokenizer, NEEDLE.format(key=key))
    question = _encode(tokenizer, QUESTION)
    answer = _encode(tokenizer, " " + key)
    return key, intro, needle, question, answer


def passkey_sample(
    tokenizer,
    context_length: int,
    depth: float | None = None,
    needle_position: int | None = None,
    seed: int = 0,
    digits: int = 5,
    haystack_ids: torch.LongTensor | None = None,
) -> PasskeySample:
    """A passkey prompt of exactly `context_length` tokens.

    Args:
        tokenizer: the model's tokenizer (digits should be single tokens).
        context_length (`int`): prompt length in tokens.
        depth (`float`, *optional*): where the needle goes, as a fraction of the haystack (0 = start, 1 = end).
        needle_position (`int`, *optional*): or the exact token index of the needle (overrides `depth`).
        seed (`int`): picks the key (and the depth when neither is given).
        digits (`int`): key length.
        haystack_ids (`torch.LongTensor` of shape `(n,)`, *optional*): real text to use as filler instead of the
            classic repeated sentences; it is cycled if too short.
    """
    rng = random.Random(seed)
    key, intro, needle, question, answer = _passkey_parts(tokenizer, rng, digits)
    budget = context_length - len(intro) - len(needle) - len(question)
    if budget < 0:
        raise ValueError(
            f"context_length={context_length} is too short for a passkey prompt; use >= {context_length - budget}"
        )
    if depth is not None and not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1] (fraction of the haystack before the needle), got {depth}")
    if haystack_ids is None:
        unit = _encode(tokenizer, FILLER)
        haystack_ids = torch.tensor(unit * (budget // len(unit) + 1))
    filler = haystack_ids.repeat(budget // max(len(haystack_ids), 1) + 1)[:budget].tolist()
    if needle_position is not None:
        split = needle_position - len(intro)
        if not 0 <= split <= budget:
            raise ValueError(
                f"needle_position={needle_position} must be in [{len(intro)}, {len(intro) + budget}]"
            )
    else:
        split = round((rng.random() if depth is None else depth) * budget)
    ids = intro + filler[:split] + needle + filler[split:] + question
    return PasskeySample(
        input_ids=torch.tensor([ids]),
        answer_ids=torch.tensor([answer]),
        key=key,
        needle_position=len(intro) + split,
    )


def needle_outside_window_sample(
    tokenizer,
    context_length: int,
    num_sink_tokens: int,
    window_length: int,
    seed: int = 0,
    margin: int = 4,
    digits: int = 5,
    haystack_ids: torch.LongTensor | None = None,
) -> PasskeySample:
    """A passkey prompt whose needle ends `margin` tokens before a sink + window draft's window starts.

    A draft reading `num_sink_tokens` sink tokens plus the last `window_length` tokens cannot see the needle,
    from the first draft step on (the window only moves away as tokens are generated), and the needle is not in
    the sink either — the falsifier of windowed drafting (Windowed-MTP, arXiv 2607.21535): the target still
    answers from its full cache (lossless), only the draft's acceptance on the answer can drop.

    Args:
        tokenizer: the model's tokenizer.
        context_length (`int`): prompt length in tokens.
        num_sink_tokens (`int`): the draft's sink size `S`.
        window_length (`int`): the draft's window `W`; the needle occupies positions
            `[L - W - margin - len(needle), L - W - margin)` with `L = context_length`.
        seed (`int`): picks the key.
        margin (`int`): tokens between the needle's end and the window's start ("just outside").
        digits (`int`): key length.
        haystack_ids (`torch.LongTensor` of shape `(n,)`, *optional*): real filler text.
    """
    if margin < 0 or num_sink_tokens < 0 or window_length < 1:
        raise ValueError(
            f"need margin >= 0, num_sink_tokens >= 0, window_length >= 1; got {margin}, {num_sink_tokens}, "
            f"{window_length}"
        )
    _, intro, needle, question, _ = _passkey_parts(tokenizer, random.Random(seed), digits)
    position = context_length - window_length - margin - len(needle)
    earliest = max(num_sink_tokens, len(intro))
    if position < earliest:
        raise ValueError(
            f"context_length={context_length} cannot hold a needle outside a window of {window_length} tokens and a "
            f"sink of {num_sink_tokens}: use context_length >= {context_length + earliest - position} or a smaller "
            "window"
        )
    if window_length < len(question):
        raise ValueError(
            f"window_length={window_length} is shorter than the question ({len(question)} tokens)"
        )
    sample = passkey_sample(
        tokenizer,
        context_length,
        needle_position=position,
        seed=seed,
        digits=digits,
        haystack_ids=haystack_ids,
    )
    return sample


def build_sample(
    task: str,
    tokenizer,
    documents: list[Document] | None,
    context_length: int,
    new_tokens: int,
    seed: int = 0,
    passkey_depth: float = 0.5,
    num_sink_tokens: int = 64,
    window_length: int = 1024,
) -> TaskSample:
    """One `TaskSample` of `task` (one of `TASKS`); `num_sink_tokens`/`window_length` place the needle of
    `needle_outside_window`, `passkey_depth` the one of `passkey`."""
    if task in ("document", "code"):
        if not documents:
            raise ValueError(f"task {task!r} needs a corpus: pass --data_files or --dataset_name")
        builder = continuation_sample if task == "document" else code_completion_sample
        return builder(tokenizer, documents, context_length, new_tokens, seed=seed)
    if task == "passkey":
        sample = passkey_sample(tokenizer, context_length, depth=passkey_depth, seed=seed)
    elif task == "needle_outside_window":
        sample = needle_outside_window_sample(
            tokenizer, context_length, num_sink_tokens, window_length, seed=seed
        )
    else:
        raise ValueError(f"unknown task {task!r}; choose from {list(TASKS)}")
    return TaskSample(
        task=task,
        input_ids=sample.input_ids,
        reference_ids=sample.answer_ids,
        meta={"key": sample.key, "needle_position": sample.needle_position},
    )
