"""Questions on one long document prefilled once: the one-liner continuing the document's cache, against plain AR
continuing it (transformers' prefix caching) and against the one-liner re-reading the whole sequence.

    python benchmarks/continued_cache.py --threads 2 --context-length 8192 --questions 3 --repeats 2
    python benchmarks/continued_cache.py --threads 2 --context-length 8192 --documents 2 \
        --out benchmarks/results/continued_cache_two_documents

The document is the first `--context-length` tokens of the bundled King John (held out from the demo models'
training); it is run once through the target into a `DynamicCache`. Question q is the document followed by 32 tokens
from elsewhere in the play. Per question and repeat, interleaved in a rotating order, each on a fresh copy of the
document's cache (the copy is made outside the timing):

- `ar`: `target.generate(question, cache=copy)`, the target alone (the reference output);
- `one_liner`: `generate(question, assistant_model=drafter, cache_implementation="budgeted", cache=copy)`;
- `one_liner_growable`: the same with the document prefilled into a `GrowableCache` instead;
- `one_liner_reread`: the one-liner on the whole sequence with no cache (the document prefilled again).

The continuing calls' drafter continues the prompt it read for the document's previous question (the document's
chunks are shared); the re-reading call's drafter reads the whole sequence, so its drafter prefill is what the
first question after the document's prefill pays. Each speculative variant has its own copy of the drafter, so no
variant continues a prompt another read. `--documents N` prefills N documents (the play's first N spans of
`--context-length` tokens) and asks their questions in turn: each document's questions continue its own prompt.

Each call's wall time (from the call to its last token) and decode rate (after its first emitted chunk); the ratios
are per question and repeat, medians over them. Every output must be the reference's. Writes
`benchmarks/results/continued_cache.{json,md}`. Run it alone: a second busy process stalls torch's threads.

`--temperature T` samples instead (the bundled drafter trained for sampling; the same seed for every call of a
question and repeat, so AR and the one-liner draw from the same distribution, not the same tokens: outputs are not
compared) and writes `continued_cache_sampling.{json,md}`.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import DynamicCache

from hf_budgetdraft.cache import GrowableCache
from hf_budgetdraft.compat import cache_kwargs
from hf_budgetdraft.demo import load_demo_models
from hf_budgetdraft.demo.documents import DEMO_TEXT
from hf_budgetdraft.runs.timed_call import timed_generate

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import run_record, run_text, write_results  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
QUESTION_TOKENS = 32
VARIANTS = ("ar", "one_liner", "one_liner_growable", "one_liner_reread")


@dataclass(frozen=True)
class Question:
    """A prompt `ids (1, L + 32)`: document `document`'s `L` tokens, then the question's."""

    document: int
    ids: torch.LongTensor


def questions(
    tokens: torch.LongTensor, context_length: int, count: int, documents: int = 1
) -> list[Question]:
    """`count` prompts a document, `(1, context_length + 32)` each: document d (the play's d-th `context_length`
    tokens), then 32 tokens from after the last document; the documents taken in turn, question by question."""
    start = context_length * documents
    stride = (tokens.shape[1] - start - QUESTION_TOKENS) // max(count * documents, 1)
    if stride < QUESTION_TOKENS:
        raise ValueError(
            f"the play has {tokens.shape[1]} tokens: too few for {count} questions on {documents} document(s) of "
            f"{context_length}; ask for fewer or shorter"
        )
    asked = []
    for q in range(count):
        for d in range(documents):
            s = start + stride * (q * documents + d)
            document = tokens[:, d * context_length : (d + 1) * context_length]
            asked.append(Question(d, torch.cat([document, tokens[:, s : s + QUESTION_TOKENS]], dim=1)))
    return asked


def one_call(
    variant: str,
    target,
    drafters: dict,
    question: Question,
    caches: list[dict],
    new_tokens: int,
    sampling,
    seed,
):
    """One timed call of `variant`; every speculative variant has its own drafter, so one's kept prompts (those a
    continuing call's drafter continues) are not another's."""
    document_caches = caches[question.document]
    if variant == "ar":
        return timed_generate(
            target,
            question.ids,
            new_tokens,
            sampling=sampling,
            seed=seed,
            **cache_kwargs(copy.deepcopy(document_caches["dynamic"])),
        )
    speculative = dict(
        assistant_model=drafters[variant], cache_implementation="budgeted", sampling=sampling, seed=seed
    )
    if variant == "one_liner":
        cache = copy.deepcopy(document_caches["dynamic"])
    elif variant == "one_liner_growable":
        cache = copy.deepcopy(document_caches["growable"])
    else:
        cache = None
    extra = {} if cache is None else cache_kwargs(cache)
    return timed_generate(target, question.ids, new_tokens, **speculative, **extra)


def prefilled_caches(target, document: torch.LongTensor) -> dict:
    """The document `(1, L)` run once through `target` into a `DynamicCache` and a `GrowableCache`."""
    caches = {
        "dynamic": DynamicCache(config=target.config),
        "growable": GrowableCache(config=target.config, initial_capacity=document.shape[1] + 1024),
    }
    for cache in caches.values():
        with torch.no_grad():
            target(document, **cache_kwargs(cache))
    return caches


def measure(pair, prompts: list[Question], new_tokens: int, repeats: int, sampling=None) -> list[dict]:
    documents = {p.document: p.ids[:, : p.ids.shape[1] - QUESTION_TOKENS] for p in prompts}
    caches = [prefilled_caches(pair.target, documents[d]) for d in sorted(documents)]
    drafter = pair.drafter_for(do_sample=sampling is not None)
    drafters = {v: copy.deepcopy(drafter) for v in VARIANTS[1:]}
    for v in VARIANTS[1:]:  # warm-up: every path's first call
        one_call(v, pair.target, drafters, prompts[0], caches, 8, sampling, seed=0)
    rows = []
    for repeat in range(repeats):
        for q, question in enumerate(prompts):
            shift = (repeat * len(prompts) + q) % len(VARIANTS)
            order = VARIANTS[shift:] + VARIANTS[:shift]
            seed = repeat * len(prompts) + q
            runs = {
                v: one_call(v, pair.target, drafters, question, caches, new_tokens, sampling, seed)
                for v in order
            }
            reference = runs["ar"].new_ids
            rows.append(
                {
                    "repeat": repeat,
                    "question": q,
                    "document": question.document,
                    **{
                        v: {
                            "seconds": run.seconds,
                            "decode_tokens_per_s": run.decode_tokens_per_second or run.tokens_per_second,
                            "identical": None if sampling else bool(torch.equal(run.new_ids, reference)),
                            "tokens_per_round": run.stats.mean_accepted_length if run.stats.rounds else None,
                            "first_token_seconds": run.first_token_seconds,
                            "draft_prefill_seconds": run.stats.draft_prefill_seconds,
                        }
                        for v, run in runs.items()
                    },
                }
            )
            print(repeat, q, {v: round(r.seconds, 2) for v, r in runs.items()}, flush=True)
    return rows


def summary(rows: list[dict]) -> dict:
    def median_ratio(top: str, bottom: str, field: str, invert: bool = False) -> float:
        ratios = [r[top][field] / r[bottom][field] for r in rows]
        return statistics.median([1 / x for x in ratios] if invert else ratios)

    return {
        "identical": None
        if rows[0]["ar"]["identical"] is None  # sampled: nothing to compare
        else all(r[v]["identical"] for r in rows for v in VARIANTS),
        "seconds": {v: statistics.median(r[v]["seconds"] for r in rows) for v in VARIANTS},
        "first_token_seconds": {
            v: statistics.median(r[v]["first_token_seconds"] for r in rows) for v in VARIANTS
        },
        "draft_prefill_seconds": {
            v: statistics.median(r[v]["draft_prefill_seconds"] for r in rows) for v in VARIANTS[1:]
        },
        "tokens_per_round": {
            v: statistics.median(r[v]["tokens_per_round"] for r in rows) for v in VARIANTS[1:]
        },
        "decode_speedup_vs_ar": {v: median_ratio(v, "ar", "decode_tokens_per_s") for v in VARIANTS[1:]},
        "call_speedup_vs_ar": {v: median_ratio(v, "ar", "seconds", invert=True) for v in VARIANTS[1:]},
        "reread_over_continued_seconds": median_ratio("one_liner_reread", "one_liner", "seconds"),
    }


def table(result: dict) -> str:
    s, meta = result["summary"], result["meta"]
    if meta["temperature"] is None:
        outputs = f"Greedy; every output identical to AR's: {s['identical']}."
    else:
        outputs = (
            f"Sampling at temperature {meta['temperature']} (the drafter trained for sampling; one seed per question "
            "and repeat, outputs not compared)."
        )
    documents = meta.get("documents", 1)
    if documents == 1:
        title, asked = "One document, many questions", f"{meta['questions']} questions"
    else:
        title = f"{documents} documents taken in turn, many questions"
        asked = f"{meta['questions']} questions on each of {documents} documents, asked in turn,"
    lines = [
        f"# {title}: continuing its cache ({meta['context_length']} tokens, {meta['new_tokens']} new tokens)",
        "",
        f"{run_text(meta)}; {asked} x {meta['repeats']} repeats, medians. {outputs} A continuing call's drafter "
        "continues the prompt it read for the document's previous question; the re-reading call's drafter prefill "
        "is a whole read.",
        "",
        "| call | seconds | first token (s) | drafter prefill (s) | tokens a round | decode vs AR | call vs AR |",
        "|---|---|---|---|---|---|---|",
        f"| ar (continues a DynamicCache) | {s['seconds']['ar']:.2f} | {s['first_token_seconds']['ar']:.2f} | - "
        "| - | 1.00x | 1.00x |",
    ]
    for v in VARIANTS[1:]:
        lines.append(
            f"| {v} | {s['seconds'][v]:.2f} | {s['first_token_seconds'][v]:.2f} | {s['draft_prefill_seconds'][v]:.2f} "
            f"| {s['tokens_per_round'][v]:.2f} | {s['decode_speedup_vs_ar'][v]:.2f}x | {s['call_speedup_vs_ar'][v]:.2f}x |"
        )
    lines += [
        "",
        f"Re-reading the document costs {s['reread_over_continued_seconds']:.1f}x the continued call.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context-length", type=int, default=8192)
    parser.add_argument("--questions", type=int, default=3, help="questions a document")
    parser.add_argument(
        "--documents", type=int, default=1, help="documents, asked in turn (each prefilled once)"
    )
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--temperature", type=float, default=None, help="sample at this temperature (default: greedy)"
    )
    parser.add_argument("--out", type=Path, default=None, help="default: results/continued_cache[_sampling]")
    args = parser.parse_args(argv)
    if args.temperature is not None and not 0 < args.temperature <= 2:
        parser.error(f"--temperature must be in (0, 2], got {args.temperature}")
    sampling = None if args.temperature is None else {"temperature": args.temperature}
    out = args.out or RESULTS / ("continued_cache" if sampling is None else "continued_cache_sampling")
    torch.set_num_threads(args.threads)
    pair = load_demo_models()
    tokens = pair.tokenizer(DEMO_TEXT.read_text(encoding="utf-8"), return_tensors="pt").input_ids
    if not 1 <= args.documents <= 8:
        parser.error(f"--documents must be in [1, 8], got {args.documents}")
    prompts = questions(tokens, args.context_length, args.questions, args.documents)
    rows = measure(pair, prompts, args.new_tokens, args.repeats, sampling)
    meta = {
        **run_record(args.threads),
        **{
            k: getattr(args, k)
            for k in ("context_length", "documents", "questions", "new_tokens", "repeats", "temperature")
        },
    }
    result = {"meta": meta, "summary": summary(rows), "rows": rows}
    write_results(out, result, table(result))


if __name__ == "__main__":
    main()
