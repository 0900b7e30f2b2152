"""What a Gemma 4 assistant's draft step costs with the target's whole full-attention states and with a sink + window
of them, as the context grows.

    python benchmarks/assistant_window_cost.py                       # contexts 1K-64K, about 2 minutes
    python benchmarks/assistant_window_cost.py --contexts 1024 4096 --repeats 5 --out /tmp/cost

One draft step is `assistant(inputs_embeds, position_ids, shared_kv_states)`, as transformers'
`SinglePositionMultiTokenCandidateGenerator` calls it; the states are random tensors of the target's shapes (the
full-attention layer's keys/values for the whole context, the sliding layer's for its window), the assistant has
random weights at the sizes below (a stand-in, not a released assistant). The two variants run interleaved, each
timed as the median of `--repeats` blocks of `--steps` steps, and the table gives their ratio. Writes
`benchmarks/results/assistant_window_cost.{json,md}`. Run it alone: it sets the thread count and times wall clock.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import run_record, run_text, write_results  # noqa: E402

from hf_budgetdraft.generation.windowed_assistant import SinkWindowRead, read_states  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "assistant_window_cost"
ASSISTANT = dict(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=1024,
    num_hidden_layers=2,
    layer_types=["sliding_attention", "full_attention"],
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=64,
    global_head_dim=256,
    sliding_window=512,
    hidden_size_per_layer_input=0,
    vocab_size_per_layer_input=0,
    num_kv_shared_layers=2,
)
BACKBONE = 512  # the target's hidden size


def build_assistant() -> Gemma4AssistantForCausalLM:
    config = Gemma4AssistantConfig(
        text_config=dict(ASSISTANT, model_type="gemma4_text"), backbone_hidden_size=BACKBONE
    )
    torch.manual_seed(0)
    return Gemma4AssistantForCausalLM(config).eval()


def shared_states(context: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Random target states: full attention over `context` positions, sliding over its window."""
    kv_heads, window = ASSISTANT["num_key_value_heads"], min(context, ASSISTANT["sliding_window"])
    full = [torch.randn(1, kv_heads, context, ASSISTANT["global_head_dim"]) for _ in range(2)]
    sliding = [torch.randn(1, kv_heads, window, ASSISTANT["head_dim"]) for _ in range(2)]
    return {"full_attention": tuple(full), "sliding_attention": tuple(sliding)}


@torch.no_grad()
def step_seconds(assistant, states, context: int, steps: int) -> float:
    """Mean seconds of one draft step over `steps` steps."""
    embeds = torch.randn(1, 1, 2 * BACKBONE)
    positions = torch.tensor([[context - 1]])
    start = time.perf_counter()
    for _ in range(steps):
        assistant(inputs_embeds=embeds, position_ids=positions, shared_kv_states=states)
    return (time.perf_counter() - start) / steps


def measure(contexts: list[int], sink: int, window: int, repeats: int, steps: int) -> list[dict]:
    assistant, rows = build_assistant(), []
    for context in contexts:
        states = shared_states(context)
        variants = {
            "whole": states,
            "sink_window": read_states(states, context, SinkWindowRead(sink, window)),
        }
        times = {name: [] for name in variants}
        step_seconds(assistant, variants["whole"], context, 2)  # warm-up
        for _ in range(repeats):
            for name, given in variants.items():  # interleaved
                times[name].append(step_seconds(assistant, given, context, steps))
        whole, windowed = (statistics.median(times[name]) * 1e3 for name in variants)
        rows.append(
            {"context": context, "whole_ms": whole, "sink_window_ms": windowed, "ratio": whole / windowed}
        )
        print(
            f"{context:>7} whole {whole:7.3f} ms  sink+window {windowed:7.3f} ms  {whole / windowed:5.2f}x",
            flush=True,
        )
    return rows


def table(result: dict) -> str:
    meta = result["meta"]
    lines = [
        "# A Gemma 4 assistant's draft step: the target's whole full-attention states against a sink + window",
        "",
        f"{run_text(meta)}, {meta['threads']} threads; sink {meta['sink']} + window {meta['window']}; random weights "
        f"and states (assistant: {ASSISTANT['num_hidden_layers']} layers, hidden {ASSISTANT['hidden_size']}, "
        f"global head dim {ASSISTANT['global_head_dim']}); median of {meta['repeats']} interleaved blocks of "
        f"{meta['steps']} steps. `python benchmarks/assistant_window_cost.py`.",
        "",
        "| context | whole (ms/step) | sink + window (ms/step) | whole / windowed |",
        "|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['context']:,} | {row['whole_ms']:.3f} | {row['sink_window_ms']:.3f} | {row['ratio']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384, 65536])
    parser.add_argument("--sink", type=int, default=64)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if (
        not all(1 <= c <= 1 << 20 for c in args.contexts)
        or not 1 <= args.repeats <= 100
        or not 1 <= args.steps <= 1000
    ):
        parser.error("--contexts in [1, 2**20], --repeats in [1, 100] and --steps in [1, 1000]")
    torch.set_num_threads(args.threads)
    rows = measure(args.contexts, args.sink, args.window, args.repeats, args.steps)
    meta = {**run_record(threads=args.threads), "sink": args.sink, "window": args.window}
    result = {"meta": {**meta, "repeats": args.repeats, "steps": args.steps}, "rows": rows}
    write_results(args.out, result, table(result), echo=False)


if __name__ == "__main__":
    main()
