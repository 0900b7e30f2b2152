"""The `families` part of `gpu_round.py`: drafters whose compiled step needs more than full attention, on the device.

A drafter's sliding layers are fixed-shape rings on the static draft cache (`StaticSlidingLayer`), and layers that
reuse an earlier layer's keys (Gemma 3n / Gemma 4) find its slot mask through the key buffer; both compile into the
draft step's one graph on CPU. This part checks it where it matters, with CUDA's compile setting (CUDA graphs): tiny
random drafters of each kind, fp32 with TF32 off, drafting for a copy of themselves over a window covering the
call (every draft should be accepted), twice (the second call compiles nothing); a full-attention target on the
device round with a sliding drafter of its vocabulary; and a target with sliding layers on the device round, whose
compiled verification reads them from rollback rings (`RingSlidingLayer`). Output against the target's own greedy
output.
"""

from __future__ import annotations

import copy

import gpu_round_real
import gpu_round_rows as rows
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from hf_budgetdraft import record_speculation

_SLIDING = ["sliding_attention", "full_attention"] * 2
SHAPE = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_hidden_layers=4,
    max_position_embeddings=8192,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=0,
)
FAMILIES = {  # name: (model_type, config beyond SHAPE)
    "gemma3_sliding": ("gemma3_text", dict(layer_types=_SLIDING, query_pre_attn_scalar=32)),
    "cohere2_sliding": ("cohere2", dict(layer_types=_SLIDING)),
    "mistral_all_sliding": ("mistral", {}),
    "gemma4_kv_sharing": (
        "gemma4_text",
        dict(
            layer_types=_SLIDING,
            num_kv_shared_layers=2,
            vocab_size_per_layer_input=512,
            hidden_size_per_layer_input=16,
        ),
    ),
}
SIZES = {
    "gpu": dict(context=1024, sliding_window=64, new_tokens=48),
    "smoke": dict(context=120, sliding_window=24, new_tokens=12),
}


def build(model_type: str, extra: dict, sliding_window: int | None, device: torch.device, seed: int = 0):
    """A tiny random model of `model_type` on `device` (fp32, sdpa; `sliding_window` `None`: full attention), its LM
    head scaled so its argmax clears rounding."""
    window = {} if sliding_window is None else {"sliding_window": sliding_window}
    config = AutoConfig.for_model(model_type, **SHAPE, **window, **extra)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(device).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(3.0)
    return model


def _speculate(target, drafter, ids, sizes: dict, smoke: bool, cache_config: dict):
    """`target.generate` with `drafter` on a sink + window cache; in the CPU smoke the drafter's step and the device
    round's verification compiled without inductor (CUDA compiles both from the first call by itself)."""
    smoke_compile = {}
    if smoke:
        drafter.generation_config.compile_config = rows.smoke_one_liner()["compile_config"]
        smoke_compile = {"compile_config": rows.smoke_one_liner()["compile_config"]}
    with record_speculation() as stats:
        out = target.generate(
            ids,
            assistant_model=drafter,
            do_sample=False,
            max_new_tokens=sizes["new_tokens"],
            cache_implementation="sink_window",
            cache_config={"num_sink_tokens": 4, "draft_length": 4, **cache_config},
            **smoke_compile,
        )
    return out, stats


def _draft_step_checks(report, name: str, first: dict, second: dict) -> None:
    report.check(
        f"{name}.compiled_first_call",
        first.get("compiled") and first["eager_calls"] == first["recompiles"] == 0,
        first,
    )
    report.check(
        f"{name}.nothing_compiled_in_second_call",
        second.get("compiled")
        and second["graphs_compiled"] == second["recompiles"] == 0
        and second["eager_calls"] == 0
        and second["compiled_calls"] > 0,
        second,
    )


def _judged(report, target, ids, name: str, out, stats, reference) -> dict:
    """One call's row: its output judged against the target's own greedy `reference` (fp32 margin), with its
    accepted and proposed drafts, plan reasons and runtime record."""
    row = gpu_round_real.judge(report, target, ids, name, out, reference, gpu_round_real.FP32_MARGIN)
    accepted, proposed = sum(stats.accepted_per_round), sum(stats.proposed_per_round)
    row.update(accepted=accepted, proposed=proposed, plan=stats.plan.reasons, runtime=stats.runtime)
    return row


def self_drafting(report, name: str, device: torch.device, smoke: bool, sizes: dict) -> dict:
    """One family's copy drafting for it over a covering window, twice."""
    model_type, extra = FAMILIES[name]
    target = build(model_type, extra, sizes["sliding_window"], device)
    ids = torch.randint(
        3, SHAPE["vocab_size"], (1, sizes["context"]), generator=torch.Generator().manual_seed(1)
    )
    ids = ids.to(device)
    reference = target.generate(ids, do_sample=False, max_new_tokens=sizes["new_tokens"])
    drafter = copy.deepcopy(target)
    covering = {"window_length": sizes["context"] + sizes["new_tokens"]}
    calls = [_speculate(target, drafter, ids, sizes, smoke, covering) for _ in range(2)]
    result = {}
    for k, (out, stats) in enumerate(calls):
        row = _judged(report, target, ids, f"families.{name}.call{k}", out, stats, reference)
        accepted, proposed = row["accepted"], row["proposed"]
        report.check(f"families.{name}.call{k}.static", stats.plan.spec.static, row)
        # the copy reads every key: only a compiled step rounding across an argmax near-tie may disagree
        report.check(
            f"families.{name}.call{k}.accepts_the_copy", proposed > 0 and accepted >= 0.9 * proposed, row
        )
        result[f"call{k}"] = row
    first, second = (stats.runtime["draft_step"] for _, stats in calls)
    _draft_step_checks(report, f"families.{name}", first, second)
    return result


def _twice_on_the_device_round(report, name: str, target, drafter, seed: int, sizes: dict, smoke: bool):
    """`target` with `drafter` (window 32) on the device round twice over one random prompt: each call judged against
    the target's own greedy output and checked to have run the device round, the draft step's compilation checked
    across the two. Returns `(calls, rows)`: the `(output, stats)` pairs and each call's row."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, SHAPE["vocab_size"], (1, sizes["context"]), generator=generator).to(target.device)
    reference = target.generate(ids, do_sample=False, max_new_tokens=sizes["new_tokens"])
    config = {"window_length": 32, **({"device_round": True, "compile_verify": True} if smoke else {})}
    calls = [_speculate(target, drafter, ids, sizes, smoke, config) for _ in range(2)]
    rows = {}
    for k, (out, stats) in enumerate(calls):
        row = _judged(report, target, ids, f"{name}.call{k}", out, stats, reference)
        report.check(f"{name}.call{k}.device_round", (stats.runtime or {}).get("loop") == "device_round", row)
        rows[f"call{k}"] = row
    _draft_step_checks(report, name, *(stats.runtime["draft_step"] for _, stats in calls))
    return calls, rows


def device_round(report, device: torch.device, smoke: bool, sizes: dict) -> dict:
    """A full-attention target on the device round, its sliding drafter compiled (random weights: the output is
    what is checked, acceptance is near zero)."""
    target = build("llama", {}, None, device, seed=1)
    drafter = build(*FAMILIES["gemma3_sliding"], sizes["sliding_window"], device)
    name = "families.device_round_sliding_drafter"
    return _twice_on_the_device_round(report, name, target, drafter, 2, sizes, smoke)[1]


def sliding_target(report, device: torch.device, smoke: bool, sizes: dict) -> dict:
    """A target with sliding layers on the device round: they verify on rollback rings (`RingSlidingLayer`), the
    verification compiled; a copy of it drafts over a window narrower than the call, so drafts are rejected and the
    rings roll back. Twice: the second call compiles nothing."""
    target = build(*FAMILIES["gemma3_sliding"], sizes["sliding_window"], device)
    name = "families.device_round_sliding_target"
    calls, rows = _twice_on_the_device_round(report, name, target, copy.deepcopy(target), 3, sizes, smoke)
    for k, (_, stats) in enumerate(calls):
        row = rows[f"call{k}"]
        report.check(
            f"{name}.call{k}.rings", (stats.runtime.get("verify") or {}).get("ring_layers", 0) > 0, row
        )
        report.check(f"{name}.call{k}.rejected_drafts_rolled_back", row["accepted"] < row["proposed"], row)
    first, second = (stats.runtime["verify"] for _, stats in calls)
    report.check(
        f"{name}.verify_compiled",
        first["compiled"] and first["failure"] is None and first["eager_calls"] == first["recompiles"] == 0,
        first,
    )
    report.check(
        f"{name}.verify_compiles_nothing_in_second_call",
        second["new_shapes"] == second["graphs_compiled"] == second["eager_calls"] == 0
        and second["compiled_calls"] > 0,
        second,
    )
    return rows


def families(report, device: torch.device, smoke: bool) -> dict:
    """Every family drafting for itself, then the device round with a sliding drafter; fp32, TF32 off."""
    sizes = SIZES["smoke" if smoke else "gpu"]
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    result = {name: self_drafting(report, name, device, smoke, sizes) for name in FAMILIES}
    result["device_round_sliding_drafter"] = device_round(report, device, smoke, sizes)
    result["device_round_sliding_target"] = sliding_target(report, device, smoke, sizes)
    return result
