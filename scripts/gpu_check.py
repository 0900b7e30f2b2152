"""The GPU checks of the varlen / static-cache paths, as one prepared script sized for one H200, JSON out.

    python scripts/gpu_check.py --out gpu-check-out            # on a CUDA machine
    python scripts/gpu_check.py --out smoke-out --cpu-smoke    # the same logic at tiny sizes on CPU

Sections (each recorded even if another fails; the JSON is rewritten after every section):

1. `kernels` — `sparse_varlen_attention` through every packed kernel this machine has (flash-attn
   `flash_attn_varlen_func`, torch `varlen_attn`, the SDPA fallback) on ragged per-(row, KV-head) key sets with GQA,
   a causal 4-token block and a one-token step, forward and backward, against fp32 masked SDPA.
2. `greedy` — greedy output of speculative decoding == the target's own greedy output, on the GPU paths: the draft on
   `budgetdraft_varlen` (varlen kernel), dynamic and static (`cache_config={"static": True}`, compiled by generate
   with CUDA graphs) sink/window and budgeted caches, in fp32 (every diff must be 0) and bf16.
3. `noise_envelope` — bf16: native (stock full-cache draft) vs AR divergence beside windowed vs native divergence,
   with the target's logit margin at each first divergence (a near-tie is noise; the draft never touches the
   target's logits, so a windowed divergence at a large margin would be a bug).
4. `training_step` — one BudgetDraft training step (full-cache branch + sparse views) with the drafter on
   `budgetdraft_varlen`, loss and gradients against the same step on stock `sdpa`, then an optimizer step.
5. `cost_curves` — an 8B-shaped bf16 target and a 68M drafter at 8K-32K: the target's step and verification curve,
   the drafter's step on full / sink-window / budgeted caches, eager and compiled, plain `generate()` against the
   one-liner with a round's host time, and the speed-up those costs give (`gpu_cost_curves.py`).

Writes `<out>/gpu_check.json`; exit code 0 when every check passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import copy
import logging
import math
import platform
import sys
import time
import traceback
from pathlib import Path

import torch
import transformers
from transformers import CompileConfig

import hf_budgetdraft
from hf_budgetdraft import record_speculation
from hf_budgetdraft.attention import varlen
from hf_budgetdraft.demo.random_models import smoke_pair
from hf_budgetdraft.generation.compiled_step import dynamo_graphs_so_far
from hf_budgetdraft.generation.draft_length.clock import synchronize
from hf_budgetdraft.runs.token_diff import divergence_margin, noise_envelope, token_diff
from hf_budgetdraft.trainer.losses import budgetdraft_loss, hard_distillation_loss
from hf_budgetdraft.trainer.views import SparseViewSpec, full_cache, run_shared_prefix, view_logits

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the test oracle of the kernels
from attention_oracles import masked_sdpa_reference  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_cost_curves  # noqa: E402
from gpu_report import Report  # noqa: E402

VARLEN = varlen.NAME
# run in this order; the costs take the longest
SECTIONS = ("kernels", "greedy", "training_step", "cost_curves")
# fp32: a first divergence under this target logit margin is rounding between forward shapes, not a bug
FP32_MARGIN_TOLERANCE = 1e-3

GPU_SIZES = dict(
    kernel=dict(batch=3, q_heads=32, kv_heads=8, kv_length=2048, head_dim=128),
    greedy=dict(prompt=2048, new_tokens=96, gamma=4, repeats=2, sink=16, window=240, budget=256),
    cost=gpu_cost_curves.GPU,
    train=dict(batch=2, prefix=1024, continuation=64, budgets=[128, 256]),
)
SMOKE_SIZES = dict(
    kernel=dict(batch=2, q_heads=4, kv_heads=2, kv_length=40, head_dim=16),
    greedy=dict(prompt=96, new_tokens=16, gamma=3, repeats=2, sink=4, window=28, budget=32),
    cost=gpu_cost_curves.SMOKE,
    train=dict(batch=2, prefix=64, continuation=8, budgets=[16, 24]),
)


def environment(report: Report, device: torch.device) -> dict:
    info = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "hf_budgetdraft": hf_budgetdraft.__version__,
        "python": platform.python_version(),
        "device": str(device),
        "varlen_backends": varlen.available_backends(),
        "flash_attn_package": varlen.flash_attn_available(),
        "torch_varlen_attn": varlen.torch_varlen_attn() is not None,
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
        if varlen.flash_attn_available():
            import flash_attn

            info["flash_attn_version"] = flash_attn.__version__
    return info


# ---------------------------------------------------------------------------------------------------------------
# 1. kernels
# ---------------------------------------------------------------------------------------------------------------


def kernels(report: Report, device: torch.device, sizes: dict) -> list[dict]:
    batch, heads, kv_heads = sizes["batch"], sizes["q_heads"], sizes["kv_heads"]
    length, dim = sizes["kv_length"], sizes["head_dim"]
    generator = torch.Generator(device="cpu").manual_seed(0)
    rows = []
    backends = [name for name, ok in varlen.available_backends().items() if ok]
    dtypes = [torch.bfloat16, torch.float32] if device.type == "cuda" else [torch.float32, torch.bfloat16]
    for q_length, causal in ((4, True), (1, False)):
        for per_head in (False, True):
            query = torch.randn(batch, heads, q_length, dim, generator=generator)
            key = torch.randn(batch, kv_heads, length, dim, generator=generator)
            value = torch.randn(batch, kv_heads, length, dim, generator=generator)
            valid = torch.rand(batch, kv_heads if per_head else 1, length, generator=generator) < 0.5
            valid[..., -q_length:] = True  # the new block
            ref_inputs = [t.to(device).clone().requires_grad_() for t in (query, key, value)]
            reference = masked_sdpa_reference(*ref_inputs, valid.to(device), causal=causal)
            reference.float().square().sum().backward()
            for backend in backends:
                for dtype in dtypes:
                    if backend != "sdpa_packed" and dtype == torch.float32:
                        continue  # flash kernels take fp16/bf16 only
                    inputs = [t.to(device, dtype).clone().requires_grad_() for t in (query, key, value)]
                    out = varlen.sparse_varlen_attention(
                        *inputs, valid.to(device), causal=causal, backend=backend
                    )
                    out.float().square().sum().backward()
                    tolerance = 2e-5 if dtype == torch.float32 else 3e-2
                    forward_error = float((out.detach().float() - reference.detach().float()).abs().max())
                    grad_error = max(
                        float((a.grad.float() - r.grad.float()).abs().max() / r.grad.float().abs().max())
                        for a, r in zip(inputs, ref_inputs, strict=True)
                    )
                    row = {
                        "backend": backend,
                        "dtype": str(dtype).removeprefix("torch."),
                        "q_length": q_length,
                        "causal": causal,
                        "key_sets": "per_kv_head" if per_head else "per_row",
                        "max_abs_error": forward_error,
                        "max_rel_grad_error": grad_error,
                    }
                    rows.append(row)
                    name = f"kernels.{backend}.{row['dtype']}.q{q_length}.{row['key_sets']}"
                    report.check(name, forward_error <= tolerance and grad_error <= 5 * tolerance, row)
    for missing in sorted(set(varlen.available_backends()) - set(backends)):
        report.skip(f"kernels.{missing}", "not available on this machine")
    return rows


# ---------------------------------------------------------------------------------------------------------------
# 2. + 3. greedy equivalence and the bf16 noise envelope
# ---------------------------------------------------------------------------------------------------------------


def _configure(drafter, gamma: int) -> None:
    config = drafter.generation_config
    config.num_assistant_tokens, config.num_assistant_tokens_schedule = gamma, "constant"
    config.assistant_confidence_threshold = 0.0


def _greedy_runs(target, drafters: dict, ids, new_tokens: int, caches: dict, repeats: int, device):
    """`{label: [generated tokens (n,) per repeat]}` and the last repeat's speculation stats per label.
    `drafters`: `"native"` (stock assisted), `"sparse"` (the configured one) and `"oneliner"` (as loaded)."""
    prompt = ids.shape[1]
    labels = ["ar", "native", "oneliner", *caches]
    outputs: dict[str, list[torch.Tensor]] = {label: [] for label in labels}
    stats_by_label, errors = {}, {}
    graphs = []  # graphs torch.compile built during each repeat (the static drafts compile in generate)
    for repeat in range(repeats):
        graphs_before = dynamo_graphs_so_far()
        for label in labels:
            kwargs = dict(do_sample=False, max_new_tokens=new_tokens)
            if label == "native":
                kwargs["assistant_model"] = drafters["native"]
            elif label == "oneliner":  # the README's call: the DraftSpec defaults decide everything
                kwargs.update(assistant_model=drafters["oneliner"], cache_implementation="budgeted")
            elif label != "ar":
                implementation, cache_config = caches[label]
                kwargs.update(
                    assistant_model=drafters["sparse"],
                    cache_implementation=implementation,
                    cache_config=cache_config,
                )
            try:
                with torch.inference_mode(), record_speculation() as stats:
                    began = time.perf_counter()
                    out = target.generate(ids, **kwargs)
                    synchronize(device)
                    seconds = time.perf_counter() - began
            except Exception as error:  # one broken path must not hide the others' results
                errors.setdefault(label, f"{error!r}\n{traceback.format_exc()}")
                continue
            outputs[label].append(out[0, prompt:].cpu())
            if repeat == repeats - 1:
                stats_by_label[label] = {
                    "seconds_last_repeat": round(seconds, 4),
                    "rounds": stats.rounds,
                    "mean_accepted_length": stats.mean_accepted_length if stats.rounds else None,
                }
        graphs.append(dynamo_graphs_so_far() - graphs_before)
    outputs = {label: runs for label, runs in outputs.items() if len(runs) == repeats}
    return outputs, stats_by_label, graphs, errors


def _greedy_caches(sizes: dict) -> dict:
    """label -> (cache_implementation, cache_config) of the sparse drafts; the static ones compile in generate."""
    sink, window, budget = sizes["sink"], sizes["window"], sizes["budget"]
    slack = max(8, sizes["gamma"])
    return {
        "sink_window": (
            "sink_window",
            {"num_sink_tokens": sink, "window_length": window, "slack": slack, "static": False},
        ),
        "sink_window_static": (
            "sink_window",
            {"num_sink_tokens": sink, "window_length": window, "slack": slack, "static": True},
        ),
        "budgeted_static": (
            "budgeted",
            {"budget": budget, "policy": "chunk", "window_length": window, "slack": slack, "static": True},
        ),
        "budgeted_snapkv": (
            "budgeted",
            {
                "budget": budget,
                "policy": "snapkv",
                "policy_kwargs": {"window_size": 8},
                "slack": slack,
                "static": False,
            },
        ),
    }


def _greedy_models(device: torch.device, dtype: torch.dtype, sizes: dict, smoke: bool):
    """`(target, drafters)`: the smoke pair in `dtype` on `device`, with the drafter three ways: `native` (stock
    sdpa, full cache), `sparse` (`budgetdraft_varlen`, its step compiled) and `oneliner` (as loaded)."""
    target, drafter = smoke_pair(seed=0, max_position_embeddings=sizes["prompt"] + sizes["new_tokens"] + 64)
    target, drafter = target.to(device, dtype), drafter.to(device, dtype)
    native_drafter = copy.deepcopy(drafter)  # stock sdpa, full cache: "native"
    oneliner_drafter = copy.deepcopy(drafter)  # as loaded: no draft-length or compile settings
    drafter.set_attn_implementation(VARLEN)
    for model in (drafter, native_drafter):
        _configure(model, sizes["gamma"])
    compile_config = (
        CompileConfig(fullgraph=True, backend="eager", mode=None) if smoke else CompileConfig(fullgraph=True)
    )
    compile_config._compile_all_devices = True  # CPU smoke: compile anyway (CUDA compiles by default)
    drafter.generation_config.compile_config = compile_config
    return target, {"native": native_drafter, "sparse": drafter, "oneliner": oneliner_drafter}


def _greedy_rows(target, ids, outputs: dict, stats_by_label: dict) -> dict:
    """label -> differing tokens against AR, the first one and, where they differ, the target's own logit margin
    there."""
    rows = {}
    for label, runs_of_label in outputs.items():
        diff = token_diff(runs_of_label[0], outputs["ar"][0])
        row = {"diff_vs_ar": diff.diff_tokens, "first_diff": diff.first_diff, **stats_by_label[label]}
        if diff.first_diff is not None and diff.first_diff < min(
            len(runs_of_label[0]), len(outputs["ar"][0])
        ):
            with torch.inference_mode():
                row["target_margin_at_first_diff"] = divergence_margin(
                    target, ids, outputs["ar"][0], runs_of_label[0], diff.first_diff
                )
        rows[label] = row
    return rows


def _check_greedy_rows(
    report: Report, dtype: torch.dtype, rows: dict, outputs: dict, caches: dict, result: dict
):
    """Every row identical to AR, or diverging only where the target's own logits nearly tie (bf16: also the
    noise envelope of the runs into `result`)."""
    if dtype == torch.float32:
        for label, row in rows.items():
            # fp32 on a GPU: a γ+1-token verify forward may round differently from a 1-token AR step, so a
            # flip at a margin of ~1e-5 is noise; anything at a larger margin is a bug (CPU: always 0 diffs)
            margin = row.get("target_margin_at_first_diff")
            ok = row["diff_vs_ar"] == 0 or (margin is not None and abs(margin) <= FP32_MARGIN_TOLERANCE)
            report.check(f"greedy.fp32.{label}", ok, row)
        return
    pairs = [("native_vs_ar", "native", "ar")] + [("windowed_vs_native", label, "native") for label in caches]
    pairs += [("windowed_vs_ar", label, "ar") for label in caches]
    result["envelope"]["bfloat16"] = noise_envelope(outputs, pairs)
    for label, row in rows.items():
        margin = row.get("target_margin_at_first_diff")
        # bf16: a divergence is numerical noise only at an argmax near-tie of the target's own logits
        ok = row["diff_vs_ar"] == 0 or (margin is not None and abs(margin) <= report.margin_tolerance)
        report.check(f"greedy.bf16.{label}", ok, row)


def greedy(report: Report, device: torch.device, sizes: dict, smoke: bool) -> dict:
    caches = _greedy_caches(sizes)
    result: dict = {"settings": dict(sizes), "runs": {}, "envelope": {}}
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 2048, (1, sizes["prompt"]), generator=generator).to(device)
    for dtype in (torch.float32, torch.bfloat16):
        dtype_name = str(dtype).removeprefix("torch.")
        target, drafters = _greedy_models(device, dtype, sizes, smoke)
        torch._dynamo.reset()  # fresh compile caches: the recompile counts below are this run's
        outputs, stats_by_label, graphs, errors = _greedy_runs(
            target, drafters, ids, sizes["new_tokens"], caches, sizes["repeats"], device
        )
        for label, error in errors.items():
            report.check(f"greedy.{dtype_name}.{label}.ran", False, error.splitlines()[0])
            result.setdefault("errors", {}).setdefault(dtype_name, {})[label] = error
        result.setdefault("compiled_graphs_per_repeat", {})[dtype_name] = graphs
        # the static drafts' decode step compiles once per cache kind, never again as the context grows
        report.check(f"greedy.{dtype_name}.no_recompile_after_first_repeat", sum(graphs[1:]) == 0, graphs)
        rows = _greedy_rows(target, ids, outputs, stats_by_label)
        result["runs"][dtype_name] = rows
        _check_greedy_rows(report, dtype, rows, outputs, caches, result)
        del target, drafters
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return result


# ---------------------------------------------------------------------------------------------------------------
# 5. one training step with sparse views
# ---------------------------------------------------------------------------------------------------------------


def _training_loss(
    drafter, teacher_labels, prefix, continuation, spec: SparseViewSpec, budgets
) -> torch.Tensor:
    """BudgetDraft's L = L_A + λ·L_C (λ = 1), as `BudgetDraftTrainer.compute_loss` computes it."""
    shared = run_shared_prefix(drafter, prefix, spec.query_window)
    loss_full = hard_distillation_loss(
        view_logits(drafter, continuation, full_cache(drafter.config, shared)), teacher_labels
    )
    views = [
        hard_distillation_loss(
            view_logits(drafter, continuation, spec.build(drafter.config, shared, budget)), teacher_labels
        )
        for budget in budgets
    ]
    return budgetdraft_loss(loss_full, views, sparse_loss_weight=1.0)


def training_step(report: Report, device: torch.device, sizes: dict) -> dict:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    prefix_length, continuation_length = sizes["prefix"], sizes["continuation"]
    target, drafter = smoke_pair(seed=0, max_position_embeddings=prefix_length + continuation_length + 8)
    target, drafter = target.to(device, dtype), drafter.to(device, dtype)
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 2048, (sizes["batch"], prefix_length + continuation_length), generator=generator)
    ids = ids.to(device)
    prefix, continuation = ids[:, :prefix_length], ids[:, prefix_length:]
    with torch.no_grad():
        labels = target(input_ids=ids, logits_to_keep=continuation_length).logits.argmax(dim=-1)  # (B, C)
    specs = {
        # window >= continuation: every view is a plain causal block -> the varlen kernel
        "budgeted_chunk": SparseViewSpec(kind="budgeted", policy="chunk", window_length=continuation_length),
        # the window slides during the block -> a windowed mask -> budgetdraft_sdpa's masked path
        "sink_window": SparseViewSpec(kind="sink_window", num_sink_tokens=4),
    }
    result = {"dtype": str(dtype).removeprefix("torch."), "views": {}}
    reference = copy.deepcopy(drafter).train()  # stock sdpa
    student = drafter.train()
    student.set_attn_implementation(VARLEN)
    result["varlen_backend"] = varlen.resolve_backend("auto", torch.empty(1, device=device, dtype=dtype))
    tolerance = 3e-2 if dtype == torch.bfloat16 else 1e-4
    for name, spec in specs.items():
        losses = {}
        grads = {}
        for label, model in (("budgetdraft_varlen", student), ("sdpa", reference)):
            model.zero_grad(set_to_none=True)
            loss = _training_loss(model, labels, prefix, continuation, spec, sizes["budgets"])
            loss.backward()
            losses[label] = float(loss.detach())
            grads[label] = torch.cat(
                [p.grad.float().reshape(-1) for p in model.parameters() if p.grad is not None]
            )
        grad_error = float((grads["budgetdraft_varlen"] - grads["sdpa"]).norm() / grads["sdpa"].norm())
        row = {
            "loss": losses,
            "relative_grad_difference": grad_error,
            "grad_norm": float(grads["budgetdraft_varlen"].norm()),
        }
        result["views"][name] = row
        loss_gap = abs(losses["budgetdraft_varlen"] - losses["sdpa"]) / max(abs(losses["sdpa"]), 1e-6)
        report.check(
            f"training_step.{name}.matches_sdpa", loss_gap <= tolerance and grad_error <= 5 * tolerance, row
        )
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-3)
    spec = specs["budgeted_chunk"]
    optimizer.zero_grad(set_to_none=True)
    before = _training_loss(student, labels, prefix, continuation, spec, sizes["budgets"])
    before.backward()
    optimizer.step()
    with torch.no_grad():
        after = _training_loss(student, labels, prefix, continuation, spec, sizes["budgets"])
    result["optimizer_step"] = {"loss_before": before.item(), "loss_after": after.item()}
    report.check("training_step.optimizer_step_finite", math.isfinite(float(after)), result["optimizer_step"])
    return result


# ---------------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="folder for gpu_check.json")
    parser.add_argument(
        "--cpu-smoke", action="store_true", help="tiny sizes on CPU: exercises the logic, not the GPU"
    )
    parser.add_argument(
        "--time-budget", type=float, default=420.0, help="seconds; late optional parts are skipped"
    )
    parser.add_argument(
        "--contexts",
        type=int,
        nargs="+",
        default=None,
        help="cost_curves contexts (default 8192 16384 32768)",
    )
    parser.add_argument(
        "--margin-tolerance",
        type=float,
        default=0.25,
        help="bf16: largest |target logit margin| at a first divergence still counted as an argmax near-tie",
    )
    parser.add_argument(
        "--sections",
        nargs="+",
        default=list(SECTIONS),
        choices=list(SECTIONS),
    )
    args = parser.parse_args(argv)
    # the package's debug records (a failed compilation's traceback) go to the log this check leaves
    package_log = logging.getLogger("hf_budgetdraft")
    package_log.setLevel(logging.DEBUG)
    if not package_log.handlers:
        package_log.addHandler(logging.StreamHandler())
    if args.cpu_smoke:
        device, sizes = torch.device("cpu"), copy.deepcopy(SMOKE_SIZES)
    else:
        if not torch.cuda.is_available():
            parser.error("no CUDA device: run on a GPU machine, or pass --cpu-smoke")
        device, sizes = torch.device("cuda"), copy.deepcopy(GPU_SIZES)
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 greedy must be exact: no TF32 matmuls
        torch.backends.cudnn.allow_tf32 = False
    # every compiled path below compiles a handful of graphs per code object; never fail a check on dynamo's cap
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    if args.contexts:
        if max(args.contexts) > 262144 or min(args.contexts) < 16:
            parser.error("--contexts must be in [16, 262144]")
        sizes["cost"]["contexts"] = args.contexts
    mode = "cpu-smoke" if args.cpu_smoke else "gpu"
    report = Report(args.out / "gpu_check.json", mode, args.time_budget, args.margin_tolerance)
    report.data["settings"] = {
        "sizes": sizes,
        "margin_tolerance": args.margin_tolerance,
        "sections": args.sections,
    }
    report.data["environment"] = environment(report, device)
    report.write()
    smoke = args.cpu_smoke
    plan = {
        "kernels": (kernels, device, sizes["kernel"]),
        "greedy": (greedy, device, sizes["greedy"], smoke),
        "cost_curves": (gpu_cost_curves.cost_curves, device, sizes["cost"], smoke),
        "training_step": (training_step, device, sizes["train"]),
    }
    for name in SECTIONS:
        if name in args.sections:
            report.section(name, *plan[name])
    report.write()
    print(
        f"wrote {report.path} in {report.elapsed():.0f} s: all_passed={report.data['all_passed']}", flush=True
    )
    return 0 if report.data["all_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
