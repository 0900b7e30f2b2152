"""The `real` part of `gpu_round.py`: the bundled pair on the device.

Every path (the one-liner's defaults, transformers' loop, both draft caches static and dynamic, the verification
eager, the one-liner continuing a prefilled cache, a left-padded batch of 4) against the target's own greedy output: fp32 with TF32 off (identical, or a first
divergence at a target margin under `FP32_MARGIN`), bf16 (a first divergence only at an argmax near-tie). Then the
one-liner against (b), `generate(cache_implementation="static")`, at 8K in bf16 with a round's exposed host time:
with models this small the round is nearly all host time, so this is the direct measure of the loop's overhead.
"""

from __future__ import annotations

import copy
import statistics

import gpu_round_rows as rows
import torch
from transformers import DynamicCache

from hf_budgetdraft import record_speculation
from hf_budgetdraft.compat import cache_kwargs
from hf_budgetdraft.demo import load_demo_models
from hf_budgetdraft.demo.documents import DEMO_TEXT
from hf_budgetdraft.runs.token_diff import divergence_margin, token_diff

FP32_MARGIN = 1e-3  # fp32: a γ+1-token verification may round differently from a one-token step
BF16_MARGIN = 0.25  # bf16: the largest |target margin| at a first divergence counted as a near-tie
PATHS = {
    "oneliner": ("budgeted", {}),
    "device_round_sink_window_static": ("sink_window", {"static": True, "device_round": True}),
    "device_round_budgeted_dynamic": ("budgeted", {"static": False, "device_round": True}),
    "device_round_verify_eager": ("budgeted", {"device_round": True, "compile_verify": False}),
    "transformers_loop_static": ("budgeted", {"static": True, "device_round": False}),
    "transformers_loop_sink_window_dynamic": ("sink_window", {"static": False, "device_round": False}),
    # the draft's budget selected again at every step, inside the compiled step's attention
    "oneliner_policy_dynamic": ("budgeted", {"policy": "dynamic"}),
}
SIZES = {
    "gpu": dict(context=8192, new_tokens=128, repeats=3),
    "smoke": dict(context=200, new_tokens=12, repeats=1),
}


def _prompts(tokenizer, context: int, device) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The last `context` tokens of the bundled held-out play, and four shorter rows from it for the batch."""
    ids = tokenizer(DEMO_TEXT.read_text(encoding="utf-8"), return_tensors="pt").input_ids[0]
    rows_ = [ids[-(context // 2 + 37 * k) :][: context // 2 - 29 * k] for k in range(4)]
    return ids[-context:][None].to(device), [r.to(device) for r in rows_]


def _call(target, drafter, ids, new_tokens, implementation, cache_config, smoke: bool, **kwargs):
    if smoke and cache_config.get("device_round") is not False:  # CPU: compile without inductor
        kwargs["compile_config"] = rows.smoke_one_liner()["compile_config"]
    with record_speculation() as stats:
        out = target.generate(
            ids,
            assistant_model=drafter,
            do_sample=False,
            max_new_tokens=new_tokens,
            cache_implementation=implementation,
            cache_config=cache_config,
            **kwargs,
        )
    return out, stats


def judge(report, target, ids, name: str, out, reference, tolerance: float) -> dict:
    """Check `out` against the target's own `reference` (identical, or a first divergence at a target margin within
    `tolerance`); the diff row."""
    prompt = ids.shape[1]
    diff = token_diff(out[0, prompt:], reference[0, prompt:])
    row = {"diff_tokens": diff.diff_tokens, "first_diff": diff.first_diff}
    if diff.first_diff is not None and diff.first_diff < min(out.shape[1], reference.shape[1]) - prompt:
        row["target_margin"] = divergence_margin(
            target, ids, reference[0, prompt:], out[0, prompt:], diff.first_diff
        )
    ok = diff.diff_tokens == 0 or abs(row.get("target_margin", float("inf"))) <= tolerance
    report.check(name, ok, row)
    return row


def _batch(report, target, drafter, batch_rows, sizes, dtype_name, tolerance) -> dict:
    """A left-padded batch of 4 against each row's own greedy output."""
    width = max(len(r) for r in batch_rows)
    pad = 0
    ids = torch.stack([torch.cat([r.new_full((width - len(r),), pad), r]) for r in batch_rows])
    mask = torch.stack([torch.cat([r.new_zeros(width - len(r)), r.new_ones(len(r))]) for r in batch_rows])
    out = target.generate(
        ids,
        attention_mask=mask,
        assistant_model=drafter,
        do_sample=False,
        max_new_tokens=sizes["new_tokens"],
        cache_implementation="budgeted",
        pad_token_id=pad,
    )
    result = {}
    for k, row in enumerate(batch_rows):
        alone = target.generate(row[None], do_sample=False, max_new_tokens=sizes["new_tokens"])
        mine = torch.cat([row, out[k, width:]])[None]
        result[k] = judge(
            report, target, row[None], f"real.{dtype_name}.batch_row{k}", mine, alone, tolerance
        )
    return result


def identity(report, target, drafter, prompts, dtype_name: str, smoke: bool, sizes: dict) -> dict:
    """Every path and the batch of 4 (`prompts`: `_prompts`' pair) against the target's own greedy output."""
    ids, batch_rows = prompts
    reference = target.generate(ids, do_sample=False, max_new_tokens=sizes["new_tokens"])
    tolerance = FP32_MARGIN if dtype_name == "float32" else BF16_MARGIN
    result = {}
    for path, (cache, cache_config) in PATHS.items():
        out, stats = _call(target, drafter, ids, sizes["new_tokens"], cache, cache_config, smoke)
        row = judge(report, target, ids, f"real.{dtype_name}.{path}", out, reference, tolerance)
        row.update(runtime=stats.runtime, tokens_a_round=stats.mean_accepted_length)
        result[path] = row
    result["continued_cache"] = _continued(report, target, drafter, ids, reference, dtype_name, smoke, sizes)
    result["batch_of_4"] = _batch(report, target, drafter, batch_rows, sizes, dtype_name, tolerance)
    return result


def _continued(report, target, drafter, ids, reference, dtype_name: str, smoke: bool, sizes: dict) -> dict:
    """The one-liner (its defaults: the device round on CUDA; forced in the CPU smoke) continuing a cache
    prefilled with all but the prompt's last 64 tokens, against the target's own output on the whole prompt; then
    the same question on a copy of that cache, the drafter continuing the prompt it read in the first call."""
    cache = DynamicCache(config=target.config)
    with torch.no_grad():
        target(ids[:, :-64], **cache_kwargs(cache))
    again = copy.deepcopy(cache)
    config = {"device_round": True} if smoke else {}
    out, stats = _call(
        target, drafter, ids, sizes["new_tokens"], "budgeted", config, smoke, **cache_kwargs(cache)
    )
    tolerance = FP32_MARGIN if dtype_name == "float32" else BF16_MARGIN
    name = f"real.{dtype_name}.continued_cache"
    row = judge(report, target, ids, name, out, reference, tolerance)
    row.update(runtime=stats.runtime, cache_tokens=cache.get_seq_length(), output_tokens=out.shape[1])
    report.check(f"{name}_length", cache.get_seq_length() == out.shape[1] - 1, row)
    report.check(f"{name}_device_round", (stats.runtime or {}).get("loop") == "device_round")
    second, second_stats = _call(
        target, drafter, ids, sizes["new_tokens"], "budgeted", config, smoke, **cache_kwargs(again)
    )
    row.update(
        draft_prefill_seconds=stats.draft_prefill_seconds,
        second_draft_prefill_seconds=second_stats.draft_prefill_seconds,
        second_identical=bool(torch.equal(second, out)),
    )
    report.check(f"{name}_second_call_identical", row["second_identical"], row)
    return row


def speed(report, target, drafter, ids, smoke: bool, sizes: dict) -> dict:
    """The one-liner against (b) at 8K, paired repeats, and its exposed host ms a drafting round."""
    one_liner = {"assistant_model": drafter, "cache_implementation": "budgeted"}
    if smoke:
        one_liner.update(rows.smoke_one_liner())
    calls = {"b_static_compiled": {"cache_implementation": "static"}, "d_oneliner": one_liner}
    for kwargs in calls.values():  # warm: compilations and captures
        rows.decode_rate(target, ids, sizes["new_tokens"], kwargs, None, 0)
    rates = {name: [] for name in calls}
    for repeat in range(sizes["repeats"]):
        for name, kwargs in calls.items():
            rates[name].append(rows.decode_rate(target, ids, sizes["new_tokens"], kwargs, None, repeat)[0])
    spans = rows.ForwardSpans(target.device)
    with spans.installed(), record_speculation() as stats:
        target.generate(ids, do_sample=False, max_new_tokens=sizes["new_tokens"], **one_liner)
    ratio = statistics.median(
        d / b for d, b in zip(rates["d_oneliner"], rates["b_static_compiled"], strict=True)
    )
    result = {
        "decode_tokens_per_s": {k: statistics.median(v) for k, v in rates.items()},
        "runs_tokens_per_s": rates,
        "d_over_b": ratio,
        "tokens_a_round": stats.mean_accepted_length,
        **spans.summary(stats),
        "runtime": stats.runtime,
    }
    report.check("real.speed.device_round_ran", (stats.runtime or {}).get("loop") == "device_round", result)
    drafting_rounds = stats.rounds - stats.ar_rounds
    report.check("real.speed.compiled_ran", rows.compiled_steps_ran(stats.runtime or {}, drafting_rounds))
    return result


def real(report, device: torch.device, smoke: bool) -> dict:
    """Identity in fp32, then in bf16 and the speed rows on the same bf16 pair: its compiled graphs are reused."""
    sizes = SIZES["smoke" if smoke else "gpu"]
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 greedy must be exact: no TF32 matmuls
        torch.backends.cudnn.allow_tf32 = False
    result = {"identity": {}}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        demo = load_demo_models(dtype)
        target, drafter = demo.target.to(device), demo.drafter.to(device)
        prompts = _prompts(demo.tokenizer, sizes["context"], device)
        result["identity"][name] = identity(report, target, drafter, prompts, name, smoke, sizes)
    result["speed"] = speed(report, target, drafter, prompts[0], smoke, sizes)  # the bf16 pair
    return result
