"""Batched speculative decoding on the bundled pair: throughput against batched AR and a full-cache draft.

    python benchmarks/batched_decoding.py --threads 2

Held-out text: the licence texts Debian ships in /usr/share/common-licenses (outside the corpus: no bundled model
saw them) followed by the bundled held-out play (King John); row i of a batch is a passage at an offset spread over
that stream, its length drawn from [7/8, 1] of the context (ragged, left-padded). Per cell, every method runs on
the same batch, back to back, in an order that rotates with the repeat (`hf_budgetdraft.eval.batched_bench`):

- `ar`: batched AR on the fast target (`budgetdraft_sdpa` + `GrowableCache`);
- `speculative`: `target.generate(batch, attention_mask=mask, assistant_model=drafter,
  cache_implementation="budgeted")` with every default (budget 512, window 256, adaptive draft length);
- `full_draft`: the same loop, the drafter reading its full (ragged) cache.

Parts: the goal cells (8K x B 4 and 8, 16K x B 4; all methods; repeats), the scaling grid (AR, the loop alone and
the one-liner), sampling at T = 0.8, and `fit` / `fit16` (8K x B 4 and 8; 16K x B 4; all methods; for
`--text king_john`: text the drafter fits). Writes `benchmarks/results/batched_<part>.{json,md}`. Run it alone: a
second busy process on 2 cores stalls torch's threads.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

import hf_budgetdraft  # noqa: F401  (registers the cache implementations)
from hf_budgetdraft.demo import load_demo_models
from hf_budgetdraft.demo.documents import DEMO_TEXT, licence_text
from hf_budgetdraft.eval.batched_bench import batched_grid, grid_markdown, summarise_grid
from hf_budgetdraft.runs.batch_call import BATCH_METHODS

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import run_record, run_text, write_results  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"

# part -> (contexts and their batch sizes, methods, new tokens, repeats, sampling)
PARTS = {
    "goals": ({8192: [4, 8], 16384: [4]}, BATCH_METHODS, 128, 2, None),
    "scaling": (
        {2048: [1, 2, 4, 8, 16], 8192: [1, 2, 4, 8, 16], 16384: [1, 2, 8]},
        ("ar", "loop_ar", "speculative"),
        64,
        2,
        None,
    ),
    "sampling": ({8192: [4]}, ("ar", "loop_ar", "speculative"), 128, 2, {"temperature": 0.8}),
    # with --text king_john: the goal cells at 8K on text the drafter fits, to separate acceptance from loop cost
    "fit": ({8192: [4, 8]}, BATCH_METHODS, 128, 2, None),
    "fit16": ({16384: [4]}, BATCH_METHODS, 128, 2, None),
}


def held_out_stream(tokenizer, text_name: str = "mixed") -> torch.LongTensor:
    """`mixed`: the licence texts then the held-out play; `king_john`: the play alone (text the drafter fits)."""
    prose = licence_text()
    play = DEMO_TEXT.read_text(encoding="utf-8")
    text = play if text_name == "king_john" else prose + "\n\n" + play
    return tokenizer(text, return_tensors="pt").input_ids[0]


def run_part(name: str, demo, stream: torch.LongTensor, threads: int, text_name: str) -> None:
    cells, methods, new_tokens, repeats, sampling = PARTS[name]
    records = []
    began = time.perf_counter()
    for context, batch_sizes in cells.items():
        records += batched_grid(
            demo.target,
            demo.drafter_for(bool(sampling)),
            stream,
            [context],
            batch_sizes,
            new_tokens,
            repeats,
            methods,
            sampling,
        )
        print(
            f"{name}: {context} done after {time.perf_counter() - began:.0f} s", file=sys.stderr, flush=True
        )
    rows = summarise_grid(records)
    meta = {
        "command": " ".join(sys.argv),
        "part": name,
        "text": text_name,
        **run_record(threads),
        "new_tokens": new_tokens,
        "repeats": repeats,
        "sampling": sampling,
        "stream_tokens": stream.numel(),
        "seconds": time.perf_counter() - began,
    }
    stem = f"batched_{name}" + ("" if text_name == "mixed" else f"_{text_name}")
    title = (
        f"Batched decoding, {name}: bundled pair, held-out text ({text_name}), {threads} threads, {new_tokens} new tokens a row, "
        f"{repeats} interleaved repeat(s){', sampling T=0.8' if sampling else ', greedy'}; {run_text(meta)}"
    )
    write_results(
        RESULTS / stem, {"meta": meta, "summary": rows, "records": records}, grid_markdown(rows, title)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--parts", nargs="+", default=["goals", "scaling", "sampling"], choices=list(PARTS))
    parser.add_argument("--text", default="mixed", choices=["mixed", "king_john"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    demo = load_demo_models()
    stream = held_out_stream(demo.tokenizer, args.text)
    for part in args.parts:
        run_part(part, demo, stream, args.threads, args.text)


if __name__ == "__main__":
    main()
