"""Eager ops a round of the device round outside its compiled forwards: the host work a GPU pays per round besides
launching the compiled draft steps and verification (each eager op is a dispatch and, for most, a kernel launch).

A count, not a timing: every aten op dispatched while a `generate()` call runs, except inside the compiled draft
step and verification (their graphs replay as one CUDA graph each on a GPU), seen by a `TorchDispatchMode`. Two
calls of N and 2N new tokens; the difference over the difference in rounds (the per-call ops cancel). Random tiny
Llama target (2 layers; the ops a round do not depend on the width) and its first layer as the drafter, greedy, an
EOS token set that the call never meets (as a real model's generation config has one), the device round with both forwards compiled by dynamo's `eager` backend (what
the op count outside them does not depend on), fp32 and bf16, draft length 4. The acceptance of random weights sets
how many draft steps a round runs: reported beside.

    python benchmarks/round_host_ops.py --output-dir benchmarks/results
"""

from __future__ import annotations

import argparse
import collections
import sys
import traceback
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from transformers import CompileConfig, LlamaConfig, LlamaForCausalLM

import hf_budgetdraft.generation.draft_steps as draft_steps
import hf_budgetdraft.generation.static_verify as static_verify
from hf_budgetdraft import record_speculation
from hf_budgetdraft.generation.compiled_call import compiled_call

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import run_record, run_text, write_results  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
WHOLE_GRAPH = dict(backend="eager", fullgraph=True, dynamic=False, mode=None)


class EagerOps(TorchDispatchMode):
    """Counts ops by `(op, innermost hf_budgetdraft source line)` while `on`, except inside compiled forwards."""

    def __init__(self):
        super().__init__()
        self.counts, self.on, self.inside = collections.Counter(), False, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.on and not self.inside:
            frames = [f for f in traceback.extract_stack() if "hf_budgetdraft" in f.filename]
            where = f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "?"
            self.counts[(str(func), where)] += 1
        return func(*args, **(kwargs or {}))

    def compiled_call(self, model, config, variant=()):
        """`compiled_call` whose forwards run outside this mode, uncounted."""
        fn, shapes = compiled_call(model, config, variant)

        def uncounted(*args, **kwargs):
            self.inside += 1
            try:
                with _disable_current_modes():
                    return fn(*args, **kwargs)
            finally:
                self.inside -= 1

        return uncounted, shapes


def tiny_pair(dtype: torch.dtype):
    """A random 2-layer Llama target and, as its drafter, its first layer with its embeddings and head."""
    sizes = dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2
    )
    torch.manual_seed(0)
    target = (
        LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, initializer_range=0.2, **sizes)).to(dtype).eval()
    )
    drafter = LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, **sizes)).to(dtype).eval()
    drafter.load_state_dict(target.state_dict(), strict=False)  # (layer 1 is the target's alone)
    drafter.set_attn_implementation("budgetdraft_varlen")
    drafter.generation_config.compile_config = CompileConfig(**WHOLE_GRAPH)
    return target, drafter


def unmet_eos(target, ids: torch.Tensor, new_tokens: int) -> int:
    """The smallest token id the target's greedy continuation of `ids` never emits in `new_tokens` tokens."""
    out = target.generate(ids, do_sample=False, max_new_tokens=new_tokens)
    return min(set(range(target.config.vocab_size)) - set(out[0, ids.shape[1] :].tolist()))


def count(dtype: torch.dtype, new_tokens: int) -> dict:
    """Eager ops a round (total and by op and source line) and draft steps a round, for one dtype."""
    target, drafter = tiny_pair(dtype)
    ids = torch.randint(0, 128, (1, 200), generator=torch.Generator().manual_seed(0))
    eos = unmet_eos(target, ids, 2 * new_tokens)
    cache_config = {
        "budget": 32,
        "window_length": 16,
        "draft_length": 4,
        "device_round": True,
        "compile": True,
    }
    cache_config["compile_verify"] = True
    mode = EagerOps()

    def call(tokens: int):
        with record_speculation() as stats:
            target.generate(
                ids,
                assistant_model=drafter,
                cache_implementation="budgeted",
                cache_config=cache_config,
                compile_config=CompileConfig(**WHOLE_GRAPH),
                do_sample=False,
                max_new_tokens=tokens,
                eos_token_id=eos,
            )
        return stats

    patched = (draft_steps.compiled_call, static_verify.compiled_call)
    draft_steps.compiled_call = static_verify.compiled_call = mode.compiled_call
    try:
        call(new_tokens)  # compiles
        runs = []
        with mode:
            for tokens in (new_tokens, 2 * new_tokens):
                mode.counts.clear()
                mode.on = True
                stats = call(tokens)
                mode.on = False
                steps = stats.runtime["draft_step"]["compiled_calls"]
                runs.append((collections.Counter(mode.counts), stats.rounds, steps, stats.runtime["loop"]))
    finally:
        draft_steps.compiled_call, static_verify.compiled_call = patched
    (first, rounds1, steps1, loop), (second, rounds2, steps2, _) = runs
    rounds = rounds2 - rounds1
    per_round = {
        k: (second[k] - first[k]) / rounds for k in set(first) | set(second) if second[k] != first[k]
    }
    by_op = collections.Counter()
    for (op, _), value in per_round.items():
        by_op[op] += value
    return {
        "loop": loop,
        "eos_token_id": eos,
        "rounds": [rounds1, rounds2],
        "draft_steps_per_round": (steps2 - steps1) / rounds,
        "eager_ops_per_round": sum(per_round.values()),
        "by_op": {op: round(v, 2) for op, v in by_op.most_common()},
        "by_source": {
            f"{op} {where}": round(v, 2)
            for (op, where), v in sorted(per_round.items(), key=lambda kv: -kv[1])
        },
    }


def table(result: dict) -> str:
    lines = [
        "# Eager ops a round of the device round, outside its compiled forwards",
        "",
        f"{run_text(result['meta'])}; a count, not a timing (see the script's docstring).",
        "",
        "| dtype | loop | draft steps a round | eager ops a round | most frequent |",
        "|---|---|---|---|---|",
    ]
    for name, row in result["dtypes"].items():
        top = ", ".join(f"{op.removeprefix('aten.')} {v}" for op, v in list(row["by_op"].items())[:4])
        lines.append(
            f"| {name} | {row['loop']} | {row['draft_steps_per_round']:.2f} | {row['eager_ops_per_round']:.1f} | {top} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--new-tokens", type=int, default=40)
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--stem", default="round_host_ops")
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = {
        "meta": run_record(threads=1),
        "dtypes": {d: count(DTYPES[d], args.new_tokens) for d in args.dtypes},
    }
    write_results(args.output_dir / args.stem, result, table(result))


if __name__ == "__main__":
    main()
