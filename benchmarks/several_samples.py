"""Several samples of a question about a long document: the one-liner with `num_return_sequences=n` against AR
and against n single-sequence calls, with and without the document's cache at hand.

    python benchmarks/several_samples.py --threads 2 --context-length 8192 --samples 4 --repeats 3

The document is the first `--context-length` tokens of the bundled King John (held out from the demo models'
training), prefilled once into the target's `DynamicCache` outside the timing (a document already read); the
question is the 32 tokens after it. Every variant samples `n` continuations of `--new-tokens` tokens (exactly) at
T = 0.8 (the bundled sampling drafter). Per repeat, interleaved in a rotating order:

- `ar_batch`: `target.generate(ids, do_sample=True, num_return_sequences=n)`, transformers' own (it cannot continue
  a cache with n > 1, so its prefill reads the document n times, in one forward);
- `ar_sequential`: n calls of transformers' own each continuing a copy of the document's cache (prefix caching);
- `one_liner`: `generate(ids, num_return_sequences=n, assistant_model=drafter, cache_implementation="budgeted")`
  without the cache (the document read once a model, the copies sampled by the batched loop);
- `one_liner_sequential`: n one-liner calls each continuing a copy of the document's cache;
- `one_liner_continued`: one one-liner call with `num_return_sequences=n` continuing the document's cache (read,
  not written: no copy needed).

Each variant's wall time for all n samples (copies of the cache included), and its ratio to `ar_sequential`'s in
the same repeat (medians). Samples are not compared token by token (different draws);
`tests/generation/test_return_sequences.py` checks identity at top_k=1. Writes
`benchmarks/results/several_samples.{json,md}`. Run it alone: a second busy process stalls torch's threads.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from hf_budgetdraft.compat import cache_kwargs
from hf_budgetdraft.demo import load_demo_models
from hf_budgetdraft.demo.documents import DEMO_TEXT

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import run_record, run_text, write_results  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = ("ar_batch", "ar_sequential", "one_liner", "one_liner_sequential", "one_liner_continued")
QUESTION_TOKENS = 32
BASELINE = "ar_sequential"
TEMPERATURE = 0.8


def sampling(new_tokens: int, seed: int) -> dict:
    torch.manual_seed(seed)
    return dict(
        do_sample=True,
        temperature=TEMPERATURE,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=0,
    )


@torch.no_grad()
def one_call(variant: str, pair, ids, document, samples: int, new_tokens: int, seed: int) -> torch.LongTensor:
    """All `samples` continuations of `ids` `(1, P)` by `variant`, `document` the cache of its first tokens:
    `(samples, new_tokens)`."""
    drafting = variant.startswith("one_liner")
    speculative = (
        dict(assistant_model=pair.drafter_for(do_sample=True), cache_implementation="budgeted")
        if drafting
        else {}
    )
    if variant in ("ar_batch", "one_liner"):
        out = pair.target.generate(
            ids, num_return_sequences=samples, **speculative, **sampling(new_tokens, seed)
        )
    elif variant == "one_liner_continued":
        out = pair.target.generate(
            ids,
            num_return_sequences=samples,
            **cache_kwargs(document),
            **speculative,
            **sampling(new_tokens, seed),
        )
    else:
        calls = [
            pair.target.generate(
                ids,
                **cache_kwargs(copy.deepcopy(document)),
                **speculative,
                **sampling(new_tokens, seed * samples + s),
            )
            for s in range(samples)
        ]
        out = torch.cat(calls)
    return out[:, ids.shape[1] :]


def prefilled(target, document: torch.LongTensor) -> DynamicCache:
    cache = DynamicCache(config=target.config)
    with torch.no_grad():
        target(document, **cache_kwargs(cache))
    return cache


def measure(pair, ids, samples: int, new_tokens: int, repeats: int) -> list[dict]:
    short = ids[:, -512:]
    for variant in VARIANTS:  # warm-up: every path's first call
        one_call(variant, pair, short, prefilled(pair.target, short[:, :-QUESTION_TOKENS]), 2, 8, seed=0)
    document = prefilled(pair.target, ids[:, :-QUESTION_TOKENS])
    rows = []
    for repeat in range(repeats):
        order = VARIANTS[repeat % len(VARIANTS) :] + VARIANTS[: repeat % len(VARIANTS)]
        seconds = {}
        for variant in order:
            start = time.perf_counter()
            new = one_call(variant, pair, ids, document, samples, new_tokens, seed=repeat + 1)
            seconds[variant] = time.perf_counter() - start
            if new.shape != (samples, new_tokens):
                raise RuntimeError(
                    f"{variant} returned {tuple(new.shape)}, not {samples} x {new_tokens} tokens"
                )
        if document.get_seq_length() != ids.shape[1] - QUESTION_TOKENS:
            raise RuntimeError("a call wrote the document's cache")
        rows.append({"repeat": repeat, "seconds": seconds})
        print(repeat, {v: round(s, 2) for v, s in seconds.items()}, flush=True)
    return rows


def summary(rows: list[dict]) -> dict:
    return {
        variant: {
            "seconds": statistics.median(r["seconds"][variant] for r in rows),
            "speed_vs_ar_sequential": statistics.median(
                r["seconds"][BASELINE] / r["seconds"][variant] for r in rows
            ),
        }
        for variant in VARIANTS
    }


def markdown(result: dict) -> str:
    meta = result["meta"]
    lines = [
        f"# Several samples of a question about a document: {meta['samples']} x {meta['new_tokens']} tokens after "
        f"{meta['context_length']} tokens, T={TEMPERATURE}",
        "",
        f"Bundled pair, held-out King John, {meta['threads']} threads, {meta['repeats']} interleaved repeats, "
        f"medians; {run_text(meta)}. Command: `{meta['command']}`",
        "",
        "The document's cache is prefilled before the timing; `ar_batch` and `one_liner` do not use it (they read "
        "the document in the call).",
        "",
        "| variant | seconds for all samples | speed vs ar_sequential |",
        "|---|---|---|",
    ]
    for variant, row in result["summary"].items():
        lines.append(f"| {variant} | {row['seconds']:.2f} | {row['speed_vs_ar_sequential']:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context-length", type=int, default=8192)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "several_samples")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    pair = load_demo_models()
    text = pair.tokenizer(DEMO_TEXT.read_text(encoding="utf-8"), return_tensors="pt").input_ids
    if text.shape[1] < args.context_length + QUESTION_TOKENS:
        raise ValueError(
            f"--context-length {args.context_length} leaves no question in the play's {text.shape[1]} tokens"
        )
    ids = text[:, : args.context_length + QUESTION_TOKENS]
    began = time.perf_counter()
    rows = measure(pair, ids, args.samples, args.new_tokens, args.repeats)
    meta = {
        "command": " ".join(sys.argv),
        **run_record(args.threads),
        "context_length": args.context_length,
        "samples": args.samples,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "seconds": time.perf_counter() - began,
    }
    result = {"meta": meta, "summary": summary(rows), "rows": rows}
    write_results(args.out, result, markdown(result))


if __name__ == "__main__":
    main()
