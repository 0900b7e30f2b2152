"""The README's one-liner against plain AR and hand-tuned settings: greedy and sampling, decode and end to end.

    python benchmarks/fast_default.py --threads 2 --contexts 4096 8192 16384 --repeats 3

Bundled pair (`load_demo_models()`), 256 new tokens per run (exactly: `min_new_tokens = max_new_tokens`), every
row of a (text, context, repeat) cell run back to back in a rotating order, the prompt the first `context` tokens
of the text (`--passages N`: N prompts at offsets spread over the text, pooled in each cell). Texts: English prose
outside the training corpus (the licence texts Debian ships in /usr/share/common-licenses, which no bundled model
saw), and the bundled held-out play (King John). Rows:

- `ar_stock`: `target.generate(ids)` on transformers' own `sdpa` and `DynamicCache`: the greedy reference;
- `ar_fast`: the target on `budgetdraft_sdpa` with a `GrowableCache` and few-row linear layers (the fastest plain
  AR here);
- `oneliner`: `target.generate(ids, assistant_model=drafter, cache_implementation="budgeted")` and nothing else;
- `eager_step`: the one-liner drafting through the drafter's own forward (`cache_config={"lean_step": False}`);
- `gamma4`, `gamma6`, `heuristic`: the same call with `cache_config={"draft_length": ...}` (every other default);
- `oneliner+compile`, `gamma6+compile`: with `cache_config={"compile": True}` (the step compiled once, before
  timing; `gamma6+compile` is the hand-tuned setting: static cache, varlen drafter, compiled step, fast target);
- `*@T0.7`, `*@T0.8`, `*@T1.0`: sampling (`do_sample=True, temperature=T`, transformers' default top-k 50) for
  `ar_fast` and the one-liner (with the bundled `sampling_drafter`), seeded alike; `ar_stock@T` is plain sampling on
  the model as loaded and `greedy_drafter@T` the one-liner sampling with the greedy drafter (the one drafter a user
  may have), both compared with the AR rows at the same temperature;
- `full_prefill`: the one-liner with `cache_config={"prefill_window": None}` (the drafter prefills with full
  attention; the default prefills it in 1024-token windowed chunks);
- `dynamic`, `dynamic+compile`: the one-liner with `cache_config={"policy": "dynamic"}` (the draft re-selects its
  budget at every step with the step's query; a full prefill), and with its step compiled;
- `ar_fast_gemv`, `oneliner_gemv`: `ar_fast` and the one-liner with the target's linear layers on torch's own
  `F.linear` (few-row linear layers off: the default before them);
- `device_round`, `device_round+compile`: the one-liner in the package's own loop with the target on a static cache
  (`cache_config={"device_round": True}`, the CUDA rule), verifying eagerly or compiled (`"compile_verify": True`;
  the verification lengths' graphs compiled in an untimed call per context before timing, and any compiled later,
  in a timed call, counted in the table's note);
- `mtp`, `mtp@T0.8`: the target's own MTP head, `target.generate(ids, use_mtp=True,
  cache_implementation="sink_window")` and nothing else (windowed MTP's defaults: adaptive draft length, fast
  target).

The one-liner rows use their own copy of the drafter, so the compiled step of the `+compile` rows is never reused
by them (a process that compiled once reuses the step, which would flatter the default), and only their own eager
draft steps count towards its compile-when-it-pays rule (a row's `compiled` column says when that rule fired). Writes
`benchmarks/results/fast_default.{json,md}`: per row and context the median decode tokens/s, the paired decode
speed-up over `ar_stock` and `ar_fast` with a 95% bootstrap interval, end to end, tokens a round, AR steps taken,
the per-round phase costs (draft, verify, overhead) and the speed-up the cost model predicts from them. Run it
alone: a second busy process on 2 cores stalls torch's threads.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import random
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

import hf_budgetdraft  # noqa: F401  (registers the cache implementations)
from hf_budgetdraft.demo import load_demo_models
from hf_budgetdraft.demo.documents import DEMO_TEXT, licence_text
from hf_budgetdraft.eval.batched_bench import interval_text, number_text
from hf_budgetdraft.eval.runners import run_ar, run_assisted, run_mtp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import run_record, run_text, write_results  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"

# row -> (cache_config of the one-liner call, or None for plain AR; AR setup, or "mtp"; sampling temperature)
ROWS = {
    "ar_stock": (None, "stock", None),
    "ar_fast": (None, "fast", None),
    "oneliner": ({}, None, None),
    "eager_step": ({"lean_step": False}, None, None),
    "gamma4": ({"draft_length": 4}, None, None),
    "gamma6": ({"draft_length": 6}, None, None),
    "heuristic": ({"draft_length": "heuristic"}, None, None),
    "oneliner+compile": ({"compile": True}, None, None),
    "gamma6+compile": ({"draft_length": 6, "compile": True}, None, None),
    "ar_fast@T0.8": (None, "fast", 0.8),
    "oneliner@T0.8": ({}, None, 0.8),
    "ar_fast@T1.0": (None, "fast", 1.0),
    "oneliner@T1.0": ({}, None, 1.0),
    "ar_fast@T0.7": (None, "fast", 0.7),
    "oneliner@T0.7": ({}, None, 0.7),
    "ar_stock@T0.7": (None, "stock", 0.7),
    "ar_stock@T1.0": (None, "stock", 1.0),
    "greedy_drafter@T0.7": ({}, None, 0.7),
    "greedy_drafter@T1.0": ({}, None, 1.0),
    "full_prefill": ({"prefill_window": None}, None, None),
    "dynamic": ({"policy": "dynamic"}, None, None),
    "dynamic+compile": ({"policy": "dynamic", "compile": True}, None, None),
    "ar_fast_gemv": (None, "fast", None),
    "oneliner_gemv": ({}, None, None),
    "device_round": ({"device_round": True, "compile_verify": False}, None, None),
    "device_round+compile": ({"device_round": True, "compile_verify": True}, None, None),
    "mtp": ({}, "mtp", None),
    "mtp@T0.8": ({}, "mtp", 0.8),
}


def texts(tokenizer) -> dict[str, torch.LongTensor]:
    prose = licence_text()
    out = {"king_john": tokenizer(DEMO_TEXT.read_text(encoding="utf-8"), return_tensors="pt").input_ids}
    if prose:
        out = {"licences": tokenizer(prose, return_tensors="pt").input_ids, **out}
    return out


@contextlib.contextmanager
def torch_linears(model, enabled: bool) -> Iterator[None]:
    """`model`'s `nn.Linear` layers on `F.linear` inside the block: `few_row_linears` leaves a layer with a `forward`
    set on the instance alone (this single-threaded benchmark may set one; a library call never does)."""
    layers = [m for m in model.modules() if type(m) is torch.nn.Linear] if enabled else []
    for layer in layers:
        layer.forward = functools.partial(_plain_linear, layer)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward


def _plain_linear(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x, layer.weight, layer.bias)


def run_row(name: str, demo, drafters: dict, ids: torch.LongTensor, new_tokens: int, seed: int):
    with torch_linears(demo.target, name.endswith("_gemv")):
        return _run_row(name, demo, drafters, ids, new_tokens, seed)


def _run_row(name: str, demo, drafters: dict, ids: torch.LongTensor, new_tokens: int, seed: int):
    cache_config, setup, temperature = ROWS[name]
    sampling = {"temperature": temperature} if temperature else None
    torch.manual_seed(seed)
    if cache_config is None:
        return run_ar(demo.target, ids, new_tokens, setup, sampling)
    if setup == "mtp":
        return run_mtp(demo.target, ids, new_tokens, "sink_window", cache_config, sampling)
    if cache_config.get("compile"):
        drafter = drafters["compiled"]
    elif temperature and not name.startswith("greedy_drafter"):  # the drafter trained for sampling
        drafter = drafters["sampling"]
    else:  # the one-liner rows' drafter drafts for nothing else, so only their own eager steps feed its ski rental
        drafter = drafters["default" if name.startswith(("oneliner", "greedy_drafter")) else "explicit"]
    return run_assisted(
        demo.target, drafter, ids, new_tokens, None, "budgeted", cache_config, sampling=sampling
    )


def round_costs(result, ar_fast) -> dict:
    """Per decode round (the first, holding both prefills, left out): draft, verify and overhead in ms, the
    drafted and emitted tokens, and the speed-up over fast AR those costs predict."""
    stats = result.stats
    rounds = stats.rounds - 1
    if rounds < 1:
        return {}
    decode = result.seconds - result.first_token_seconds
    draft, verify = stats.decode_draft_seconds / rounds, stats.decode_verify_seconds / rounds
    overhead = max(0.0, decode / rounds - draft - verify)
    emitted = (sum(stats.accepted_per_round[1:]) + rounds) / rounds
    drafted = sum(stats.proposed_per_round[1:]) / rounds
    ar_step = 1 / ar_fast.decode_tokens_per_second
    return {
        "draft_ms": 1e3 * draft,
        "verify_ms": 1e3 * verify,
        "overhead_ms": 1e3 * overhead,
        "drafted_per_round": drafted,
        "emitted_per_round": emitted,
        "draft_ms_per_token": 1e3 * draft / drafted if drafted else None,
        "predicted_vs_fast_ar": emitted * ar_step / (draft + verify + overhead),
        # the limit: every draft free and verification as cheap as an AR step
        "limit_vs_fast_ar": emitted * ar_step / verify if verify else None,
    }


def bootstrap(values: list[float], draws: int = 2000) -> tuple[float, float, float]:
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(draws))
    return statistics.median(values), medians[int(0.025 * draws)], medians[int(0.975 * draws) - 1]


def summarise(records: list[dict]) -> list[dict]:
    rows = []
    first_seen = dict.fromkeys((r["text"], r["context"], r["row"]) for r in records)  # in the run's order
    keys = sorted(first_seen, key=lambda k: (k[0], k[1]))
    for text, context, name in keys:
        cell = [r for r in records if (r["text"], r["context"], r["row"]) == (text, context, name)]
        row = {"text": text, "context": context, "row": name, "runs": len(cell)}
        for key in ("decode_vs_ar_stock", "decode_vs_ar_fast", "e2e_vs_ar_stock", "e2e_vs_ar_fast"):
            values = [r[key] for r in cell if r.get(key)]
            if values:
                row[key] = bootstrap(values)
        for key in (
            "decode_tokens_per_second",
            "seconds",
            "mean_accepted_length",
            "ar_rounds",
            "rounds",
            "target_prefill_seconds",
            "draft_prefill_seconds",
        ):
            values = [r[key] for r in cell if r.get(key) is not None]
            row[key] = statistics.median(values) if values else None
        for key in ("draft_ms", "verify_ms", "overhead_ms", "drafted_per_round", "predicted_vs_fast_ar"):
            values = [r["costs"][key] for r in cell if r.get("costs") and r["costs"].get(key) is not None]
            row[key] = statistics.median(values) if values else None
        checked = [r["identical"] for r in cell if r["identical"] is not None]
        row["identical"] = all(checked) if checked else None  # None: no ar_stock run to compare with
        row["compiled"] = sorted({r["compiled"] for r in cell if r["compiled"] is not None})
        graphs = [r["verify_graphs_compiled"] for r in cell if r.get("verify_graphs_compiled") is not None]
        row["verify_graphs_compiled_timed"] = sum(graphs) if graphs else None
        rows.append(row)
    return rows


def identical_text(row: dict) -> str:
    """The `identical` cell: blank for sampling rows, "not checked" where the run had no `ar_stock` reference."""
    if "@T" in row["row"]:
        return ""
    return "not checked" if row["identical"] is None else str(row["identical"])


def markdown(rows: list[dict], meta: dict) -> str:
    ci, num = interval_text, number_text
    lines = [
        "# The one-liner against AR and hand-tuned settings",
        "",
        f"`{meta['command']}` — {meta['threads']} threads, run alone, {meta['new_tokens']} new tokens, "
        f"{meta['repeats']} interleaved repeats, {meta.get('passages', 1)} passage(s) a cell, "
        f"{run_text(meta)}. Medians; decode/e2e = paired ratios over the same repeat's AR with a 95% bootstrap "
        "interval. `identical` = greedy output equal to `ar_stock` (the target as loaded) in every run.",
        "",
        *(
            [
                "Fresh processes, one whole call at {context} tokens ({new_tokens} new): eager {eager_call_seconds:.1f}"
                " s, compiled step with cold inductor caches {compiled_call_cold_seconds:.1f} s, again with the "
                "caches the first left on disk {compiled_call_warm_disk_cache_seconds:.1f} s.".format(
                    **meta["fresh_process_call_seconds"]
                ),
                "",
            ]
            if meta.get("fresh_process_call_seconds")
            else []
        ),
        "| text | context | row | decode tok/s | decode vs stock AR | decode vs fast AR | e2e vs stock AR | "
        "e2e vs fast AR | tokens a round | AR steps | draft / verify / overhead ms a round | predicted vs fast "
        "AR | prefill s: target / drafter | identical |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        phases = (
            f"{num(r['draft_ms'])} / {num(r['verify_ms'])} / {num(r['overhead_ms'])}" if r["draft_ms"] else ""
        )
        prefills = (
            f"{num(r['target_prefill_seconds'], 2)} / {num(r['draft_prefill_seconds'], 2)}"
            if r.get("target_prefill_seconds")
            else ""
        )
        lines.append(
            f"| {r['text']} | {r['context']} | {r['row']} | {num(r['decode_tokens_per_second'])} | "
            f"{ci(r.get('decode_vs_ar_stock'))} | {ci(r.get('decode_vs_ar_fast'))} | "
            f"{ci(r.get('e2e_vs_ar_stock'))} | {ci(r.get('e2e_vs_ar_fast'))} | "
            f"{num(r['mean_accepted_length'], 2)} | {num(r['ar_rounds'], 0)} | {phases} | "
            f"{num(r['predicted_vs_fast_ar'], 2)} | {prefills} | {identical_text(r)} |"
        )
    compiled_late = [r for r in rows if r.get("verify_graphs_compiled_timed") is not None]
    if compiled_late:
        lines += ["", "Verification graphs compiled inside timed calls (after the untimed warm-up call): " + ", ".join(
            f"{r['row']} at {r['context']} ({r['text']}): {r['verify_graphs_compiled_timed']}" for r in compiled_late
        ) + "."]  # fmt: skip
    return "\n".join(lines) + "\n"


_COMPILE_PROBE = """
import time, torch
torch.set_num_threads({threads})
import hf_budgetdraft
from hf_budgetdraft.demo import load_demo_models
demo = load_demo_models()
ids = demo.tokenizer(open({text!r}).read(), return_tensors="pt").input_ids[:, :{context}]
began = time.perf_counter()
demo.target.generate(ids, assistant_model=demo.drafter, cache_implementation="budgeted",
                     cache_config={{"compile": {compile}}}, max_new_tokens={new_tokens}, do_sample=False)
print(time.perf_counter() - began)
"""


def compile_cost(threads: int, context: int, new_tokens: int) -> dict:
    """Seconds of one whole call in a fresh process: eager, compiled with cold inductor caches, compiled again with
    the caches the cold run left on disk (what a second process of the same user pays)."""
    import subprocess
    import sys
    import tempfile

    def call(compile_step: bool, cache_dir: str) -> float:
        code = _COMPILE_PROBE.format(
            threads=threads, text=str(DEMO_TEXT), context=context, compile=compile_step, new_tokens=new_tokens
        )
        env = {**__import__("os").environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        return float(out.stdout.strip().splitlines()[-1])

    with tempfile.TemporaryDirectory() as cache_dir:
        return {
            "context": context,
            "new_tokens": new_tokens,
            "eager_call_seconds": call(False, cache_dir),
            "compiled_call_cold_seconds": call(True, cache_dir),
            "compiled_call_warm_disk_cache_seconds": call(True, cache_dir),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--texts", nargs="+", default=None, help="licences and/or king_john (default: both)")
    parser.add_argument(
        "--passages",
        type=int,
        default=1,
        help="Passages a text and context, at offsets spread over the text (1: its start); cells pool them.",
    )
    parser.add_argument("--out", default=str(RESULTS / "fast_default"))
    parser.add_argument(
        "--compile-cost",
        action="store_true",
        help="Also time a whole call in fresh processes (cold/warm caches).",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    demo = load_demo_models()
    drafters = {name: copy.deepcopy(demo.drafter) for name in ("default", "explicit", "compiled")}
    drafters["sampling"] = demo.sampling_drafter
    prompts = {k: v for k, v in texts(demo.tokenizer).items() if args.texts is None or k in args.texts}
    if any(ROWS[r][0] and ROWS[r][0].get("compile") for r in args.rows):  # compile once, untimed
        began = time.perf_counter()
        run_row("gamma6+compile", demo, drafters, next(iter(prompts.values()))[:, :512], 16, 0)
        print(f"compiled the draft step in {time.perf_counter() - began:.1f} s (in this process)", flush=True)
    for name in (r for r in args.rows if (ROWS[r][0] or {}).get("compile_verify")):  # its graphs, untimed
        for context in args.contexts:
            began = time.perf_counter()
            run_row(name, demo, drafters, next(iter(prompts.values()))[:, :context], args.new_tokens, 0)
            print(
                f"{name}: compiled at {context} in {time.perf_counter() - began:.1f} s (untimed)", flush=True
            )
    records = []
    for repeat in range(args.repeats):
        for text, ids in prompts.items():
            for context in args.contexts:
                for offset in passage_offsets(ids.shape[1], context, args.new_tokens, args.passages):
                    prompt = ids[:, offset : offset + context]
                    order = args.rows[repeat % len(args.rows) :] + args.rows[: repeat % len(args.rows)]
                    results = {
                        name: run_row(name, demo, drafters, prompt, args.new_tokens, repeat) for name in order
                    }
                    records += cell_records(results, text, context, repeat, offset)
                    print(f"repeat {repeat} {text}@{context}+{offset}: " + ", ".join(
                        f"{r['row']} {r['decode_tokens_per_second']:.0f}" for r in records[-len(order):]
                    ), flush=True)  # fmt: skip
    rows = summarise(records)
    compile_seconds = compile_cost(args.threads, 8192, args.new_tokens) if args.compile_cost else None
    meta = {
        "command": "python benchmarks/fast_default.py " + " ".join(sys.argv[1:]),
        **run_record(args.threads),
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "passages": args.passages,
        "fresh_process_call_seconds": compile_seconds,
    }  # fmt: skip
    write_results(Path(args.out), {"meta": meta, "rows": rows, "records": records}, markdown(rows, meta))


def passage_offsets(length: int, context: int, new_tokens: int, passages: int) -> list[int]:
    """Start offsets of `passages` prompts of `context` tokens spread evenly over a text of `length` tokens (each
    leaves `new_tokens` of the text after it); none if the text is too short, `[0]` for one passage."""
    last = length - context - new_tokens
    if last < 0:
        return []
    if passages == 1:
        return [0]
    return sorted({round(i * last / (passages - 1)) for i in range(passages)})


def cell_records(results: dict, text: str, context: int, repeat: int, offset: int = 0) -> list[dict]:
    reference = results.get("ar_stock")
    records = []
    for name, result in results.items():
        temperature = ROWS[name][2]
        baselines = {
            "ar_stock": results.get("ar_stock" if temperature is None else f"ar_stock@T{temperature}"),
            "ar_fast": results.get("ar_fast" if temperature is None else f"ar_fast@T{temperature}"),
        }
        stats = result.stats
        record = {
            "text": text,
            "context": context,
            "offset": offset,
            "repeat": repeat,
            "row": name,
            "seconds": result.seconds,
            "decode_tokens_per_second": result.decode_tokens_per_second,
            "identical": bool(torch.equal(result.new_ids, reference.new_ids))
            if reference is not None and temperature is None
            else None,
            "rounds": stats.rounds or None,
            "mean_accepted_length": stats.mean_accepted_length if stats.rounds else None,
            "ar_rounds": stats.ar_rounds if stats.rounds else None,
            "compiled": stats.plan.spec.compile if stats.plan is not None else None,
            "verify_graphs_compiled": ((result.runtime or {}).get("verify") or {}).get("graphs_compiled"),
            "draft_prefill_seconds": stats.draft_prefill_seconds,
            "target_prefill_seconds": stats.target_prefill_seconds if stats.rounds else None,
            "proposed_per_round": list(stats.proposed_per_round),
            "accepted_per_round": list(stats.accepted_per_round),
        }
        for key, base in baselines.items():
            if base is not None and result.decode_tokens_per_second and base.decode_tokens_per_second:
                record[f"decode_vs_{key}"] = result.decode_tokens_per_second / base.decode_tokens_per_second
                record[f"e2e_vs_{key}"] = base.seconds / result.seconds
        if stats.rounds and baselines["ar_fast"] is not None:
            record["costs"] = round_costs(result, baselines["ar_fast"])
        records.append(record)
    return records


if __name__ == "__main__":
    main()
