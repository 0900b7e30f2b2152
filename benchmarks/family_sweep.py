"""Which of the installed transformers' causal-LM families draft on a sparse cache: a sweep over its registry.

    python benchmarks/family_sweep.py                       # every family: about 35 minutes on one core
    python benchmarks/family_sweep.py --families llama nanochat --out /tmp/sweep

Each family (a `model_type` of transformers' causal-LM auto mapping) runs in a process of its own, memory-capped
and timed out, built small from its config class with shared sizes (hidden 64, 2 layers, 4 heads, a vocabulary of
128, small experts; a few families more layers), random weights, nothing downloaded; the drafter is a copy of the
target, so rounds are accepted in part and rolled back. The target's own greedy output
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
    head_dim=16,
    max_position_embeddings=4096,
    n_embd=64,
    n_layer=2,
    n_head=4,
    d_model=64,
    # token ids inside the small vocabulary (embedding tables check their padding index)
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    # experts, latent attention and per-layer embeddings at small sizes (ignored by families without them)
    num_experts=4,
    n_routed_experts=4,
    num_local_experts=4,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    n_shared_experts=1,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    expert_ffn_hidden_size=32,
    ffn_hidden_size=128,
    kv_lora_rank=16,
    q_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=16,
    vocab_size_per_layer_input=128,
    hidden_size_per_layer_input=16,
)
# families that need more at these sizes: hybrids whose first full-attention layer comes later, latent attention
# (as many key/value heads as query heads, rotary on its rope part), per-layer patterns sized to two layers
_LATENT = {"num_key_value_heads": 4, "head_dim": 8}
_LATENT_ATTENTION = (
    "axk1",
    "axk2",
    "deepseek_v3",
    "deepseek_v32",
    "glm4_moe_lite",
    "glm_moe_dsa",
    "longcat_flash",
)
_LATENT_ATTENTION += ("minicpm3", "youtu")
_LATER_FULL_ATTENTION = ("bailing_hybrid", "olmo_hybrid", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_next")
_LATER_FULL_ATTENTION += ("qwen4_exp_text",)
FAMILY_SIZES = {
    **{f: {"num_hidden_layers": 4} for f in _LATER_FULL_ATTENTION},
    **{f: _LATENT for f in _LATENT_ATTENTION},
    **{f: {"rotary_dim": 8} for f in ("codegen", "gptj")},
    "kimi_linear": {**_LATENT, "num_hidden_layers": 5},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1},
    "bamba": {"attn_layer_indices": [1]},
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
    "recurrent_gemma": {"num_hidden_layers": 3},
    "zamba": {"num_hidden_layers": 5, "attn_layer_period": 2, "attn_layer_offset": 1},
    "gemma3n_text": {
        "layer_types": ["sliding_attention", "full_attention"],
        "num_kv_shared_layers": 0,
        "activation_sparsity_pattern": [0.0, 0.0],
        "sliding_window": 32,
    },
}
CACHES = {
    "budgeted": {"budget": 32, "window_length": 8},
    "sink_window": {"num_sink_tokens": 4, "window_length": 24},
}
PROMPT, NEW_TOKENS, MAX_PARAMETERS = 150, 16, 30_000_000
MEMORY_BYTES, SECONDS = 6 << 30, 300


def _build(model_type: str):
    """`(target, drafter)` of `model_type` at the shared sizes, random weights; the drafter is a copy of the target,
    so it accepts where the sparse draft cache keeps what the full one would, and is rejected where it does not."""
    import copy

    import torch
    from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM

    config_class = CONFIG_MAPPING[model_type]
    sizes = {**SIZES, **FAMILY_SIZES.get(model_type, {})}
    config = AutoConfig.for_model(
        model_type, **{k: v for k, v in sizes.items() if _settable(config_class, k)}
    )
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(config).eval()
    if sum(p.numel() for p in target.parameters()) > MAX_PARAMETERS:
        raise ValueError(f"more than {MAX_PARAMETERS:,} parameters at the shared sizes")
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(3.0)  # a clear argmax: greedy outputs comparable
    return target, copy.deepcopy(target)


def _settable(config_class: type, name: str) -> bool:
    """Whether `name` may be passed to `config_class`: not a size it derives (a property without a setter)."""
    attribute = getattr(config_class, name, None)
    return not isinstance(attribute, property) or attribute.fset is not None


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
