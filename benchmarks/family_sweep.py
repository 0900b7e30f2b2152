"""Which of the installed transformers' causal-LM families draft on a sparse cache: a sweep over its registry.

    python benchmarks/family_sweep.py                       # every family: about 35 minutes on one core
    python benchmarks/family_sweep.py --families llama nanochat --out /tmp/sweep

Each family (a `model_type` of transformers' causal-LM auto mapping) runs in a process of its own, memory-capped
and timed out, built small from its config class with shared sizes (hidden 64, 2 layers, 4 heads, a vocabulary of
128; the drafter the same family with 1 layer), random weights, nothing downloaded. The target's own greedy output
(16 tokens after a 150-token prompt) is compared with stock assisted generation and with the one-liner on both
draft caches. A family is

- `identical`: both caches give the target's output; `differs`: one does not (a bug);
- `refused`: a `ValueError` says why (stateful layers, a layer type with no cache, nothing to sparsify is not one:
  that runs on the model's own cache, as stock does);
- `fails`: another exception, with whether stock assisted generation fails too (a family where stock runs and the
  sparse draft fails is a gap);
- `not built`: the shared sizes do not fit its config, or its own `generate()` fails on them: not judged.

A tool to find gaps, not a test: the family matrix in `tests/` is the contract. Writes
`benchmarks/results/family_sweep.{json,md}` by default.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import warnings
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import run_record  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SIZES = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    n_embd=64,
    n_layer=2,
    n_head=4,
    d_model=64,
)
CACHES = {
    "budgeted": {"budget": 32, "window_length": 8},
    "sink_window": {"num_sink_tokens": 4, "window_length": 24},
}
PROMPT, NEW_TOKENS, MAX_PARAMETERS = 150, 16, 30_000_000
MEMORY_BYTES, SECONDS = 6 << 30, 300


def _build(model_type: str):
    """`(target, drafter)` of `model_type` at the shared sizes, random weights (the drafter: 1 layer)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    models = []
    for layers in (2, 1):
        config = AutoConfig.for_model(model_type, **{**SIZES, "num_hidden_layers": layers, "n_layer": layers})
        torch.manual_seed(0)
        models.append(AutoModelForCausalLM.from_config(config).eval())
    if sum(p.numel() for p in models[0].parameters()) > MAX_PARAMETERS:
        raise ValueError(f"more than {MAX_PARAMETERS:,} parameters at the shared sizes")
    with torch.no_grad():
        models[0].get_output_embeddings().weight.mul_(3.0)  # a clear argmax: greedy outputs comparable
    return models


def _outcome(call) -> str:
    """`"identical"`, `"differs"`, `"refused: ..."` or `"fails: ..."` for `call()` (True when identical)."""
    try:
        return "identical" if call() else "differs"
    except ValueError as error:
        return f"refused: {str(error)[:160]}"
    except Exception as error:  # noqa: BLE001 - any other failure is what the sweep reports
        return f"fails: {type(error).__name__}: {str(error)[:160]}"


def sweep_one(model_type: str) -> dict:
    """One family's row: `{family, built, stock, budgeted, sink_window}` (outcome strings)."""
    import torch

    import hf_budgetdraft

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    row = {"family": model_type}
    try:
        target, drafter = _build(model_type)
        ids = torch.randint(3, 120, (1, PROMPT), generator=torch.Generator().manual_seed(1))
        call = dict(do_sample=False, max_new_tokens=NEW_TOKENS)
        expected = target.generate(ids, **call)
    except Exception as error:  # noqa: BLE001 - a family these sizes do not build is not judged
        return {**row, "built": f"{type(error).__name__}: {str(error)[:160]}"}
    row["built"] = "yes"
    hf_budgetdraft.uninstall()
    try:
        row["stock"] = _outcome(
            lambda: torch.equal(target.generate(ids, assistant_model=drafter, **call), expected)
        )
    finally:
        hf_budgetdraft.install()
    for name, cache_config in CACHES.items():
        speculative = dict(
            assistant_model=drafter, cache_implementation=name, cache_config=cache_config, **call
        )
        row[name] = _outcome(lambda kwargs=speculative: torch.equal(target.generate(ids, **kwargs), expected))
    return row


def verdict(row: dict) -> str:
    if row["built"] != "yes":
        return "not built"
    ours = [row[name] for name in CACHES]
    if all(o == "identical" for o in ours):
        return "identical"
    if "differs" in ours:
        return "differs"
    if any(o.startswith("fails") for o in ours):
        return "fails (stock too)" if row["stock"] != "identical" else "fails"
    return "refused"


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))


def run_isolated(model_type: str) -> dict:
    """`sweep_one(model_type)` in a fresh, memory-capped process (a family may allocate without bound)."""
    try:
        done = subprocess.run(
            [sys.executable, __file__, "--one", model_type],
            capture_output=True,
            text=True,
            timeout=SECONDS,
            preexec_fn=_limited,
        )
    except subprocess.TimeoutExpired:
        return {"family": model_type, "built": f"timed out after {SECONDS} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        return {"family": model_type, "built": f"process ended with {done.returncode}: {done.stderr[-160:]}"}
    return json.loads(lines[-1])


def table(result: dict) -> str:
    rows, meta = result["rows"], result["meta"]
    counts = Counter(verdict(row) for row in rows)
    lines = [
        f"# Family sweep: transformers {meta['transformers']}, {len(rows)} causal-LM families",
        "",
        f"commit {meta['commit']}, torch {meta['torch']}, {meta['date']}; `python benchmarks/family_sweep.py` "
        "(random weights at shared small sizes; a tool to find gaps, the family matrix in tests/ is the contract).",
        "",
        "| verdict | families |",
        "|---|---|",
        *[f"| {v} | {n} |" for v, n in sorted(counts.items())],
        "",
        "| family | verdict | stock assisted | budgeted | sink_window |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        if row["built"] == "yes":
            cells = [row["stock"], row["budgeted"], row["sink_window"]]
        else:
            cells = [f"not built: {row['built'][:80]}", "", ""]
        cells = [c.replace("|", "/").replace("\n", " ") for c in cells]
        lines.append(f"| {row['family']} | {verdict(row)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--families", nargs="+", default=None, help="model types (default: every causal LM)")
    parser.add_argument("--out", type=Path, default=RESULTS / "family_sweep")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the child process's own family
    args = parser.parse_args(argv)
    if args.one is not None:
        print(json.dumps(sweep_one(args.one)), flush=True)
        return
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    families = args.families or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    unknown = sorted(set(families) - set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))
    if unknown:
        parser.error(f"not causal-LM model types of this transformers: {unknown}")
    rows = []
    for family in families:
        rows.append(run_isolated(family))
        print(family, verdict(rows[-1]), flush=True)
    result = {"meta": run_record(threads=1), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(table(result))


if __name__ == "__main__":
    main()
