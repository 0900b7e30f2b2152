"""Documents for `hf-budgetdraft train` whose continuation needs far context: the data of a drafter fine-tune
against a target that reads far context (`scripts/train_far_target.py`).

`hf-budgetdraft train` cuts text into rows of `prefix_length + continuation_length` tokens and takes its losses on
the continuation, the drafter reading the prefix through its full cache (L_A) and through budgeted views (L_C,
BudgetDraft, arXiv 2606.00144, §3). In natural text the continuation seldom depends on the far prefix, so a view
loses little and L_C has little to teach. Each document written here is one row whose continuation starts where a
far dependency does, drawn from the far target's training stream (`far_target_data.py`: held out by content):

- `text`: natural text;
- `copy`: a passage of the prefix begins again `COPY_CUE` to `MAX_CUE` tokens before the prefix ends and runs
  through the whole continuation: what follows the prefix is text seen 64 to `prefix_length` tokens earlier;
- `fact`: one to four facts planted in the prefix's first half in `far_target_data.TRAINING_FORMAT`, the prefix
  ending on a question about one of them; the continuation is the answer, then natural text.

Written as JSONL (`{"text", "kind"}`), one row per document with `--pack_across_documents False`. A document is
kept only if the tokenizer encodes its text back to exactly the ids it was built from (so the row's prefix ends
where it was built to end); the others are redrawn. With `--continuations target` the trainer replaces each
continuation by the target's own, so the drafter learns what the target does with the far context.

    python scripts/far_documents.py --data data/far --out data/far_docs.jsonl --prefix-length 1024 \\
        --continuation-length 64 --documents 512 --mix 1/2/1
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import far_target_data as data  # noqa: E402

KINDS = ("text", "copy", "fact")
MAX_CUE = 32  # the longest start of the reappearing passage inside the prefix
GAP = 64  # the shortest distance between the passage's end and its reappearance
ATTEMPTS = 50  # redraws allowed for one document whose text does not encode back to its ids
MAX_DOCUMENTS = 1_000_000


def shortest_prefix(continuation_length: int) -> int:
    """The shortest prefix a `copy` document fits in: the passage, the gap, then its reappearance's cue."""
    return 2 * MAX_CUE + continuation_length + GAP


def document(rows: data.Rows, prefix_length: int, continuation_length: int, kind: str) -> list[int]:
    """The ids of one document of `kind`, `(prefix_length + continuation_length,)`."""
    total = prefix_length + continuation_length
    if kind == "text":
        return rows.natural_text(total)
    if kind == "copy":
        ids = rows.natural_text(total)
        cue = rows.rng.randint(data.COPY_CUE, MAX_CUE)
        span, repeat = cue + continuation_length, prefix_length - cue
        source = rows.rng.randrange(0, repeat - span - GAP + 1)
        ids[repeat:total] = ids[source : source + span]
        return ids
    if kind == "fact":
        needles, question, answer = rows.facts()
        body = rows.haystack(prefix_length - len(question), needles)
        return body + question + answer + rows.natural_text(continuation_length - len(answer))
    raise ValueError(f"a document's kind is one of {KINDS}, got {kind!r}")


def write_documents(
    rows: data.Rows,
    out: Path,
    count: int,
    prefix_length: int,
    continuation_length: int,
    weights: list[float],
) -> dict:
    """Write `count` documents (kinds drawn with `weights` over `KINDS`) to the JSONL file `out`; a summary."""
    tokenizer = rows.tokenizer
    kinds = rows.rng.choices(KINDS, weights=weights, k=count)
    redrawn = Counter()
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as file:
        for kind in kinds:
            for _ in range(ATTEMPTS):
                ids = document(rows, prefix_length, continuation_length, kind)
                text = tokenizer.decode(ids)
                if tokenizer(text, add_special_tokens=False).input_ids == ids:
                    break
                redrawn[kind] += 1
            else:
                raise RuntimeError(
                    f"no {kind} document out of {ATTEMPTS} encoded back to its own ids; this tokenizer "
                    "does not round-trip the corpus's text"
                )
            file.write(json.dumps({"text": text, "kind": kind}) + "\n")
    return {
        "documents": dict(Counter(kinds)),
        "redrawn": dict(redrawn),
        "tokens_per_document": prefix_length + continuation_length,
        "prefix_length": prefix_length,
        "continuation_length": continuation_length,
    }


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--data", type=Path, default=Path("data/far"), help="train_far_target.py prepare's folder"
    )
    parser.add_argument("--out", type=Path, required=True, help="the JSONL file to write")
    parser.add_argument("--prefix-length", type=int, default=8192)
    parser.add_argument("--continuation-length", type=int, default=256)
    parser.add_argument("--documents", type=int, default=512)
    parser.add_argument("--mix", default="1/2/1", help="weights of the kinds text/copy/fact")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        args.weights = data.parse_mix(args.mix, KINDS)
    except ValueError as error:
        parser.error(str(error))
    if args.continuation_length < 16:
        parser.error(
            f"--continuation-length must be >= 16 (a fact's answer and more), got {args.continuation_length}"
        )
    if args.prefix_length < shortest_prefix(args.continuation_length):
        parser.error(
            f"--prefix-length must be >= {shortest_prefix(args.continuation_length)} for a continuation of "
            f"{args.continuation_length} (a copied passage, a gap of {GAP}, its reappearance), "
            f"got {args.prefix_length}"
        )
    if not 1 <= args.documents <= MAX_DOCUMENTS:
        parser.error(f"--documents must be in [1, {MAX_DOCUMENTS}], got {args.documents}")
    return args


def main(argv=None) -> int:
    from transformers import AutoTokenizer

    args = parse(argv)
    tokenizer = AutoTokenizer.from_pretrained(data.TOKENIZER, local_files_only=True)
    rows = data.Rows(tokenizer, data.load_tokens(args.data, "train"), args.seed)
    summary = write_documents(
        rows, args.out, args.documents, args.prefix_length, args.continuation_length, args.weights
    )
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
