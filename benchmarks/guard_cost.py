"""Host time dynamo spends checking a compiled forward's guards before each call, by decoder depth: every guard
at every step (a plain `torch.compile` of the forward, as transformers compiles its own) against the module guards
checked once per call (`hf_budgetdraft.generation.compiled_call`: the input and global guards at every step, the
model's state fingerprinted once per `generate()` call).

The forward is a one-token decode step of a random Llama on transformers' `StaticCache` (the shape of the device
round's draft step and of a verification), compiled as one graph; `--layers` sets the depths (32: an 8B target's,
2: a 68M drafter's). Widths are tiny, since guards depend on the module structure, not on tensor sizes. The
backend is dynamo's `eager` (what runs after the check does not matter here). The check is read from the profiler's
`TorchDynamo Cache Lookup` event (host time, whatever the device: on a GPU it is paid before each CUDA-graph
replay), over `--calls` calls a batch, the two variants in alternating order for `--repeats` batches; medians and
their ratio per depth. The fingerprint's own time, paid once per call of `generate()`, is timed beside it.

Run it alone (no other busy process) and report the threads:
    python benchmarks/guard_cost.py --threads 1 --output-dir benchmarks/results
Quick smoke run:
    python benchmarks/guard_cost.py --layers 2 --repeats 2 --calls 5 --output-dir /tmp/guards
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import CompileConfig, LlamaConfig, LlamaForCausalLM, StaticCache

from hf_budgetdraft.generation.compiled_call import call_model, compiled_call, module_fingerprint

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import run_record, run_text, write_results  # noqa: E402

LOOKUP_EVENT = "TorchDynamo Cache Lookup"
WHOLE_GRAPH = dict(backend="eager", fullgraph=True, dynamic=False, mode=None)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--calls", type=int, default=40, help="calls a batch")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output-dir", type=Path, required=True)
    return parser.parse_args()


def tiny_llama(layers: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )
    return LlamaForCausalLM(config).eval()


def lookup_us(fn, model, cache: StaticCache, calls: int) -> float:
    """Mean µs of dynamo's cache lookup over `calls` one-token steps (the cache's count reset first)."""
    for layer in cache.layers:
        layer.cumulative_length.zero_()
    step = dict(input_ids=torch.tensor([[7]]), position_ids=torch.tensor([[0]]), past_key_values=cache)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn(model, **step, use_cache=True)
    (event,) = [e for e in prof.key_averages() if e.key == LOOKUP_EVENT]
    return event.cpu_time_total / event.count


def fingerprint_ms(model, times: int = 5) -> float:
    start = time.perf_counter()
    for _ in range(times):
        module_fingerprint(model)
    return (time.perf_counter() - start) / times * 1e3


def measure(layers: int, args) -> dict:
    model = tiny_llama(layers)
    every_step = torch.compile(call_model, **WHOLE_GRAPH)  # transformers' way: one code object, every guard
    per_call, _ = compiled_call(model, CompileConfig(**WHOLE_GRAPH))
    variants = {"every_step": every_step, "once_per_call": per_call}
    caches = {name: StaticCache(config=model.config, max_cache_len=args.calls + 8) for name in variants}
    samples = {name: [] for name in variants}
    with torch.no_grad():
        for name, fn in variants.items():  # compile, then warm
            lookup_us(fn, model, caches[name], 3)
        for repeat in range(args.repeats):
            order = list(variants) if repeat % 2 == 0 else list(reversed(variants))
            for name in order:
                samples[name].append(lookup_us(variants[name], model, caches[name], args.calls))
    medians = {name: statistics.median(values) for name, values in samples.items()}
    return {
        "layers": layers,
        "lookup_us_median": medians,
        "lookup_us_samples": samples,
        "ratio_every_step_over_once_per_call": medians["every_step"] / medians["once_per_call"],
        "fingerprint_ms": fingerprint_ms(model),
    }


def markdown(summary: dict) -> str:
    rows = [
        "# Dynamo's guard check before each compiled step",
        "",
        "Host µs dynamo spends checking guards before each call of a one-token static-cache step of a random Llama "
        "(`TorchDynamo Cache Lookup`, medians over interleaved batches), every guard at every step against the "
        "module guards checked once per `generate()` call; the fingerprint that replaces them, timed once per call.",
        "",
        "| layers | every guard, every step (µs) | module guards once per call (µs) | ratio | fingerprint, once per call (ms) |",
        "|---:|---:|---:|---:|---:|",
    ]
    for record in summary["records"]:
        medians = record["lookup_us_median"]
        rows.append(
            f"| {record['layers']} | {medians['every_step']:.0f} | {medians['once_per_call']:.0f} | "
            f"{record['ratio_every_step_over_once_per_call']:.1f}x | {record['fingerprint_ms']:.2f} |"
        )
    rows += [
        "",
        f"{run_text(summary)}, {summary['threads']} thread(s), load average {summary['load_average_before'][0]:.2f}.",
    ]
    return "\n".join(rows)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    records = []
    for layers in args.layers:
        records.append(measure(layers, args))
        medians = records[-1]["lookup_us_median"]
        print(
            f"{layers} layers: every step {medians['every_step']:.0f} us, once per call {medians['once_per_call']:.0f} us",
            flush=True,
        )
    summary = {
        **run_record(torch.get_num_threads()),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "settings": {k: v for k, v in vars(args).items() if k != "output_dir"},
        "records": records,
    }
    write_results(args.output_dir / "guard_cost", summary, markdown(summary))


if __name__ == "__main__":
    main()
