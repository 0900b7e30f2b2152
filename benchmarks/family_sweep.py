"""Which of the installed transformers' language-model families draft on a sparse cache: a sweep over its registry.

    python benchmarks/family_sweep.py                       # every family: about 50 minutes on one core
    python benchmarks/family_sweep.py --families llama qwen2_5_vl --out /tmp/sweep

Each family (a `model_type` of transformers' causal-LM or image-text-to-text auto mapping) runs in a process of its
own, memory-capped and timed out, built small from its config class with shared sizes (hidden 64, 2 layers, 4 heads,
a vocabulary of 128, small experts; a few families more layers), random weights, nothing downloaded; a multimodal
family (LLaVA, Qwen2.5-VL, Gemma 3, ...) keeps its own wrapper and its vision or audio tower at a token size and is
given a text prompt (an image in the prompt is `tests/generation/test_multimodal_targets.py`'s). The drafter is a
copy of the target, so rounds are accepted in part and rolled back. The target's own greedy output
(16 tokens after a 150-token prompt) is compared with stock assisted generation and with the one-liner on both
draft caches. A family is

- `identical`: both caches give the target's output; `differs`: one does not (a bug);
- `refused`: a `ValueError` says why (stateful layers, a layer type with no cache, nothing to sparsify is not one:
  that runs on the model's own cache, as stock does);
- `fails`: another exception, with whether stock assisted generation fails too (a family where stock runs and the
  sparse draft fails is a gap);
- `not built`: the shared sizes do not fit its config, or its own `generate()` fails on them: not judged.

Beside the verdict, the drafter drafts once more on a sink/window cache whose window covers the whole call, on each
storage (dynamic and static slots), 4 tokens a round: reading every key, a copy of the target must accept every
draft. Fewer means a draft path computes something other than the drafter's own forward (a bias or kwarg the
sparse attention drops): output stays the target's, only acceptance shows it.

Last, the drafter's static step traced as CUDA compiles it (one whole graph, fixed shapes; dynamo's `eager` backend
runs the traced graph, so no compiler is involved) must draft what its eager step drafts, round for round, on the
`sink_window` cache whose ring wraps: a trace that loses something the eager step reads (a tensor attribute, a
Python-side state) drafts otherwise, and only acceptance shows it. `same` where it does, `not compiled: why`
where the plan keeps the step eager.

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
from provenance import run_record, write_results  # noqa: E402

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
# a multimodal family's other towers (vision, audio, ...): small, so that only the text model's cost counts
TOWER_SIZES = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=16,
    image_size=32,
    patch_size=8,
    depth=1,
    embed_dim=32,
    num_heads=2,
    out_hidden_size=64,
    projection_dim=32,
    vision_output_dim=32,
    num_global_layers=1,
    spatial_merge_size=2,
    temporal_patch_size=2,
    vocab_size=128,
)
CACHES = {
    "budgeted": {"budget": 32, "window_length": 8},
    "sink_window": {"num_sink_tokens": 4, "window_length": 24},
}
# every key kept (the window covers prompt and output), a fixed draft length: a copy of the target accepts each draft
SELF_DRAFT = {"num_sink_tokens": 4, "window_length": 1024, "draft_length": 4}
STORAGES = {"dynamic": False, "static": True}
# CUDA's draft-step compile setting, its graph run by dynamo's eager backend (traced, not compiled)
TRACED = {"backend": "eager", "fullgraph": True, "dynamic": False, "mode": None}
PROMPT, NEW_TOKENS, MAX_PARAMETERS = 150, 16, 30_000_000
MEMORY_BYTES, SECONDS = 6 << 30, 300


def _build(model_type: str):
    """`(target, drafter)` of `model_type` at the shared sizes, random weights; the drafter is a copy of the target,
    so it accepts where the sparse draft cache keeps what the full one would, and is rejected where it does not."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    config = _config(model_type)
    torch.manual_seed(0)
    causal = registered_families()[model_type] == "causal"
    auto = AutoModelForCausalLM if causal else AutoModelForImageTextToText
    target = auto.from_config(config).eval()
    if sum(p.numel() for p in target.parameters()) > MAX_PARAMETERS:
        raise ValueError(f"more than {MAX_PARAMETERS:,} parameters at the shared sizes")
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(3.0)  # a clear argmax: greedy outputs comparable
    return target, copy.deepcopy(target)


def registered_families() -> dict[str, str]:
    """Every model type transformers registers as a causal LM or an image-text-to-text model -> which of the two
    (a family in both counts as a causal LM: `AutoModelForCausalLM` builds it)."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    return {
        **{name: "image-text-to-text" for name in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES},
        **{name: "causal" for name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES},
    }


def _config(model_type: str):
    """`model_type`'s config at the shared sizes. A multimodal one (a vision, audio or other tower beside its text
    model) keeps its own defaults, its text model at the shared sizes and its other towers at `TOWER_SIZES`."""
    from transformers import CONFIG_MAPPING, AutoConfig, PreTrainedConfig

    config_class = CONFIG_MAPPING[model_type]
    sizes = {**SIZES, **FAMILY_SIZES.get(model_type, {})}
    default = config_class() if getattr(config_class, "sub_configs", None) else None
    towers = {
        name: tower
        for name in getattr(config_class, "sub_configs", {})
        if isinstance(tower := getattr(default, name, None), PreTrainedConfig)
    }
    # a text model beside vision or audio towers (not the parts of one model: MPT's attention, BLT's patcher)
    if not any(name == "text_config" or name.startswith(("vision", "audio_config")) for name in towers):
        return AutoConfig.for_model(
            model_type, **{k: v for k, v in sizes.items() if _settable(config_class, k)}
        )
    resized = {}
    for name, tower in towers.items():
        tower_sizes = TOWER_SIZES
        if name == "text_config":
            tower_sizes = {**SIZES, **FAMILY_SIZES.get(tower.model_type, FAMILY_SIZES.get(model_type, {}))}
        resized[name] = _resized(tower, tower_sizes).to_dict()
    config = config_class.from_dict({**default.to_dict(), **resized})
    return config if "text_config" in towers else _resized(config, sizes)  # else its text model is the config


def _resized(config, sizes: dict):
    """`config` with `sizes` where its class takes them; per-layer lists and maps cut to the new depth (a pattern
    its class derives from the depth is dropped and derived again), multimodal rotary sections rescaled."""
    values = config.to_dict()
    layers = values.get("num_hidden_layers")
    values.update({k: v for k, v in sizes.items() if _settable(type(config), k)})
    depth = values.get("num_hidden_layers")
    for key, value in list(values.items()):
        if key in sizes or layers is None or depth == layers:
            continue
        if key == "layer_types" and isinstance(value, list):
            values.pop(key)
        elif isinstance(value, list) and len(value) == layers:
            values[key] = value[:depth]
        elif key == "per_layer_config" and isinstance(value, dict):
            values[key] = {k: v for k, v in value.items() if int(k) < depth}
    rope = values.get("rope_parameters")
    if isinstance(rope, dict) and (
        "mrope_section" in rope
        or "mrope_section" in getattr(type(config), "ignore_keys_at_rope_validation", ())
    ):
        section = rope.get("mrope_section", [16, 24, 24])  # the default of the models that leave it out
        rotary = int(values.get("head_dim", 16) * rope.get("partial_rotary_factor", 1.0)) // 2
        scaled = [max(1, part * rotary // sum(section)) for part in section]
        scaled[0] += rotary - sum(scaled)
        values["rope_parameters"] = {**rope, "mrope_section": scaled}
    return type(config).from_dict(values)


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
    row = {"family": model_type, "kind": registered_families()[model_type]}
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
    row["self_draft"] = {
        storage: _self_draft(target, drafter, ids, expected, static) for storage, static in STORAGES.items()
    }
    row["traced_step"] = _traced_step(target, drafter, ids, expected)
    return row


def _on_sink_window(target, drafter, ids, cache_config: dict) -> tuple:
    """`(output, stats)` of one greedy one-liner call drafting on a `sink_window` cache of `cache_config`."""
    import hf_budgetdraft

    with hf_budgetdraft.record_speculation() as stats:
        out = target.generate(
            ids, assistant_model=drafter, do_sample=False, max_new_tokens=NEW_TOKENS,
            cache_implementation="sink_window", cache_config=cache_config,
        )  # fmt: skip
    return out, stats


def _traced_step(target, drafter, ids, expected) -> str:
    """`"same"` when the drafter's static step traced on CUDA's setting (`TRACED`) drafts round for round what its
    eager step drafts on the wrapping `sink_window` cache; `"differs (eager a/p, traced a/p)"`; `"not compiled:
    why"` where the plan keeps it eager; or what `_outcome` says when the output differs or a call raises."""
    import copy

    import torch
    from transformers import CompileConfig

    runs = {}

    def draft(name: str, model, compile_step: bool) -> bool:
        cache_config = {**CACHES["sink_window"], "draft_length": 4, "static": True}
        if not compile_step:
            cache_config["compile"] = False
        out, runs[name] = _on_sink_window(target, model, ids, cache_config)
        return torch.equal(out, expected)

    traced = copy.deepcopy(drafter)
    traced.generation_config.compile_config = CompileConfig(**TRACED)
    outcome = _outcome(lambda: draft("eager", drafter, False) and draft("traced", traced, True))
    if outcome != "identical":
        return outcome
    if not runs["traced"].plan.spec.compile:
        return f"not compiled: {runs['traced'].plan.reasons['compile'][:120]}"
    rounds = {name: (s.accepted_per_round, s.proposed_per_round) for name, s in runs.items()}
    if rounds["eager"] == rounds["traced"]:
        return "same"
    counts = {name: f"{sum(a)}/{sum(p)}" for name, (a, p) in rounds.items()}
    return f"differs (eager {counts['eager']}, traced {counts['traced']})"


def _self_draft(target, drafter, ids, expected, static: bool) -> str:
    """`"accepted/proposed"` drafts of the target's copy reading every key (`SELF_DRAFT`) on one storage (the
    rounds before an EOS), or what `_outcome` says when the output differs or the call raises."""
    import torch

    counts = []

    def call() -> bool:
        out, stats = _on_sink_window(target, drafter, ids, {**SELF_DRAFT, "static": static})
        rounds = list(zip(stats.accepted_per_round, stats.proposed_per_round, strict=True))
        # a call that stopped at an EOS did so in its last round, whose drafts past it count as rejected
        if out.shape[1] < ids.shape[1] + NEW_TOKENS:
            rounds = rounds[:-1]
        counts.extend([sum(a for a, _ in rounds), sum(p for _, p in rounds)])
        return torch.equal(out, expected)

    outcome = _outcome(call)
    return f"{counts[0]}/{counts[1]}" if outcome == "identical" else outcome


def drafts_short(row: dict) -> list[str]:
    """The storages on which the target's copy, reading every key, accepted fewer drafts than it proposed."""
    counts = {storage: result.split("/") for storage, result in row.get("self_draft", {}).items()}
    return [
        storage
        for storage, parts in counts.items()
        if len(parts) == 2 and parts[0].isdigit() and int(parts[0]) < int(parts[1])
    ]


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
    kind = registered_families()[model_type]
    try:
        done = subprocess.run(
            [sys.executable, __file__, "--one", model_type],
            capture_output=True,
            text=True,
            timeout=SECONDS,
            preexec_fn=_limited,
        )
    except subprocess.TimeoutExpired:
        return {"family": model_type, "kind": kind, "built": f"timed out after {SECONDS} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        return {
            "family": model_type,
            "kind": kind,
            "built": f"process ended with {done.returncode}: {done.stderr[-160:]}",
        }
    return json.loads(lines[-1])


def _short_line(rows: list[dict]) -> str:
    """The families whose copy, reading every key, accepted fewer drafts than it proposed."""
    short = {row["family"]: drafts_short(row) for row in rows if drafts_short(row)}
    named = ", ".join(f"{family} ({' and '.join(storages)})" for family, storages in short.items())
    return (
        f"Self-draft reading every key (the target's copy, a window covering the call, {SELF_DRAFT['draft_length']} "
        f"tokens a round): {len(short)} families accepted fewer drafts than proposed"
        + (f": {named}." if named else ".")
    )


def _traced_line(rows: list[dict]) -> str:
    """The families whose traced static step drafted otherwise than their eager one."""
    differ = [row["family"] for row in rows if str(row.get("traced_step", "")).startswith("differs (")]
    return (
        "Traced static step (CUDA's whole-graph setting, run by dynamo's eager backend) against the eager one, on a "
        f"wrapping sink_window ring: {len(differ)} families drafted otherwise"
        + (f": {', '.join(differ)}." if differ else ".")
    )


def table(result: dict) -> str:
    rows, meta = result["rows"], result["meta"]
    counts = Counter(verdict(row) for row in rows)
    multimodal = sum(row.get("kind") == "image-text-to-text" for row in rows)
    lines = [
        f"# Family sweep: transformers {meta['transformers']}, {len(rows) - multimodal} causal-LM and {multimodal} "
        "image-text-to-text families",
        "",
        f"commit {meta['commit']}, torch {meta['torch']}, {meta['date']}; `python benchmarks/family_sweep.py` "
        "(random weights at shared small sizes; a tool to find gaps, the family matrix in tests/ is the contract).",
        "",
        "| verdict | families |",
        "|---|---|",
        *[f"| {v} | {n} |" for v, n in sorted(counts.items())],
        "",
        _short_line(rows),
        "",
        _traced_line(rows),
        "",
        "| family | verdict | stock assisted | budgeted | sink_window | self-draft, every key (dynamic / static) "
        "| traced step |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if row["built"] == "yes":
            self_draft = row.get("self_draft", {})
            cells = [row["stock"], row["budgeted"], row["sink_window"]]
            cells.append(" / ".join(self_draft.get(storage, "not run")[:60] for storage in STORAGES))
            cells.append(row.get("traced_step", "not run")[:80])
        else:
            cells = [f"not built: {row['built'][:80]}", "", "", "", ""]
        cells = [c.replace("|", "/").replace("\n", " ") for c in cells]
        family = row["family"] + (" (image-text-to-text)" if row.get("kind") == "image-text-to-text" else "")
        lines.append(f"| {family} | {verdict(row)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--families",
        nargs="+",
        default=None,
        help="model types (default: every causal and image-text-to-text LM)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "family_sweep")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the child process's own family
    args = parser.parse_args(argv)
    if args.one is not None:
        print(json.dumps(sweep_one(args.one)), flush=True)
        return
    registered = registered_families()
    families = args.families or sorted(registered)
    unknown = sorted(set(families) - set(registered))
    if unknown:
        parser.error(f"not causal-LM or image-text-to-text model types of this transformers: {unknown}")
    rows = []
    for family in families:
        rows.append(run_isolated(family))
        print(family, verdict(rows[-1]), flush=True)
    result = {"meta": run_record(threads=1), "rows": rows}
    write_results(args.out, result, table(result), echo=False)


if __name__ == "__main__":
    main()
