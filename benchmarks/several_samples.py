"""Several samples of one long prompt: the one-liner with `num_return_sequences=n` against AR and against n
single-sequence one-liner calls continuing one prefilled cache.

    python benchmarks/several_samples.py --threads 2 --context-length 8192 --samples 4 --repeats 3

The prompt is the first `--context-length` tokens of the bundled King John (held out from the demo models'
training); every call samples `n` continuations of `--new-tokens` tokens at T = 0.8 (the bundled sampling drafter),
exactly that many each. Per repeat, interleaved in a rotating order:

- `ar`: `target.generate(ids, do_sample=True, num_return_sequences=n)`, transformers' own (its prompt is prefilled
  in one forward of n copies);
- `one_liner`: the same with `assistant_model=drafter, cache_implementation="budgeted"` (the prompt read once a
  model, the copies sampled by the batched loop);
- `one_liner_sequential`: what a user could do before: prefill the prompt once into a `DynamicCache`, then n
  one-liner calls each continuing a copy of it (the prefill and the copies timed).

Each variant's wall time for all n samples, and its ratio to `ar`'s in the same repeat (medians). Samples are not
compared token by token (different draws); `tests/generation/test_return_sequences.py` checks identity at top_k=1.
Writes `benchmarks/results/several_samples.{json,md}`. Run it alone: a second busy process stalls torch's threads.
"""

from __future__ import annotations

import argparse
import copy
import json
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
from provenance import run_record, run_text  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = ("ar", "one_liner", "one_liner_sequential")
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
def one_call(variant: str, pair, ids, samples: int, new_tokens: int, seed: int) -> torch.LongTensor:
    """All `samples` continuations of `ids` `(1, P)` by `variant`: `(samples, new_tokens)`."""
    speculative = dict(assistant_model=pair.drafter_for(do_sample=True), cache_implementation="budgeted")
    if variant == "ar":
        out = pair.target.generate(ids, num_return_sequences=samples, **sampling(new_tokens, seed))
    elif variant == "one_liner":
        out = pair.target.generate(
            ids, num_return_sequences=samples, **speculative, **sampling(new_tokens, seed)
        )
    else:
        prompt = DynamicCache(config=pair.target.config)
        pair.target(ids[:, :-1], **cache_kwargs(prompt))
        out = torch.cat(
            [
                pair.target.generate(
                    ids,
                    **cache_kwargs(copy.deepcopy(prompt)),
                    **speculative,
                    **sampling(new_tokens, seed * samples + s),
                )
                for s in range(samples)
            ]
        )
    return out[:, ids.shape[1] :]


def measure(pair, ids, samples: int, new_tokens: int, repeats: int) -> list[dict]:
    for variant in VARIANTS:  # warm-up: every path's first call
        one_call(variant, pair, ids[:, -512:], 2, 8, seed=0)
    rows = []
    for repeat in range(repeats):
        order = VARIANTS[repeat % len(VARIANTS) :] + VARIANTS[: repeat % len(VARIANTS)]
        seconds = {}
        for variant in order:
            start = time.perf_counter()
            new = one_call(variant, pair, ids, samples, new_tokens, seed=repeat + 1)
            seconds[variant] = time.perf_counter() - start
            if new.shape != (samples, new_tokens):
                raise RuntimeError(
                    f"{variant} returned {tuple(new.shape)}, not {samples} x {new_tokens} tokens"
                )
        rows.append({"repeat": repeat, "seconds": seconds})
        print(repeat, {v: round(s, 2) for v, s in seconds.items()}, flush=True)
    return rows


def summary(rows: list[dict]) -> dict:
    return {
        variant: {
            "seconds": statistics.median(r["seconds"][variant] for r in rows),
            "speed_vs_ar": statistics.median(r["seconds"]["ar"] / r["seconds"][variant] for r in rows),
        }
        for variant in VARIANTS
    }


def markdown(result: dict) -> str:
    meta = result["meta"]
    lines = [
        f"# Several samples of one prompt: {meta['samples']} x {meta['new_tokens']} tokens at "
        f"{meta['context_length']} tokens of context, T={TEMPERATURE}",
        "",
        f"Bundled pair, held-out King John, {meta['threads']} threads, {meta['repeats']} interleaved repeats, "
        f"medians; {run_text(meta)}. Command: `{meta['command']}`",
        "",
        "| variant | seconds for all samples | speed vs AR |",
        "|---|---|---|",
    ]
    for variant, row in result["summary"].items():
        lines.append(f"| {variant} | {row['seconds']:.2f} | {row['speed_vs_ar']:.2f}x |")
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
    if text.shape[1] < args.context_length:
        raise ValueError(f"--context-length {args.context_length} exceeds the play's {text.shape[1]} tokens")
    ids = text[:, : args.context_length]
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
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    args.out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
