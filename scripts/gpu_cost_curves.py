"""The `cost_curves` section of the GPU check: what a speculative round costs on this device for an 8B-class target
and a 68M drafter, and the speed-up those costs give with measured and published acceptance.

Random-weight bf16 models built on the device (timing only: no output is judged here):

- target: Llama-3.1-8B-shaped (hidden 4096, 32 layers, 32 query / 8 KV heads, MLP 14336) with a 32K vocabulary
  shared with the drafter (the Llama-2 pair of BudgetDraft's setup: Yarn-Llama-2-7B and llama-68m);
- drafter: llama-68m-shaped (hidden 768, 2 layers, 12 heads, MLP 3072).

Per context: the target's one-token step on transformers' `DynamicCache` and its verification of n = 1 ... 17 tokens on a
`GrowableCache` (`sdpa`, and the one-liner's `budgetdraft_sdpa`); the drafter's one-token
step on a full cache (eager `DynamicCache`, compiled `StaticCache`) against `sink_window` and `budgeted` draft
caches (dynamic eager; static on `budgetdraft_varlen`, eager and compiled with CUDA graphs), with each compile's
seconds. At the one-liner's context: plain `generate()` and the one-liner (fixed γ and its defaults) end to end, and
a round's host time estimated as its wall time minus its forwards' device time measured above.

The `speedup` rows (`gpu_speedup.py`) turn those costs into the best draft length per context and its expected
speed-up over plain AR.
"""

from __future__ import annotations

import copy
import statistics
import time
import traceback
import warnings

import torch
from gpu_speedup import speedups  # noqa: E402 (scripts/ is on the path)
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, StaticCache

from hf_budgetdraft import BudgetedCache, DraftSpec, SinkWindowCache
from hf_budgetdraft.attention.fast_sdpa import NAME as FAST_SDPA
from hf_budgetdraft.attention.scoped import using_attention
from hf_budgetdraft.attention.varlen import NAME as VARLEN
from hf_budgetdraft.cache import GrowableCache
from hf_budgetdraft.runs.timed_call import timed_generate

GPU = dict(
    contexts=[8192, 16384, 32768],
    vocab=32000,
    target=dict(
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
    ),
    drafter=dict(
        hidden_size=768,
        num_hidden_layers=2,
        num_attention_heads=12,
        num_key_value_heads=12,
        intermediate_size=3072,
    ),
    caches=dict(
        sink_window=dict(num_sink_tokens=64, window_length=1024), budgeted=dict(budget=512, window_length=256)
    ),
    max_verify=17,
    steps=8,
    repeats=7,
    new_tokens=64,
    oneliner_repeats=3,
    gamma=4,
)
SMOKE = dict(
    contexts=[96, 160],
    vocab=256,
    target=dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
    ),
    drafter=dict(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=64,
    ),
    caches=dict(
        sink_window=dict(num_sink_tokens=4, window_length=32), budgeted=dict(budget=32, window_length=16)
    ),
    max_verify=5,
    steps=2,
    repeats=2,
    new_tokens=8,
    oneliner_repeats=1,
    gamma=2,
)


class DeviceTimer:
    """Seconds of device work between two marks: CUDA events on CUDA (read after one synchronisation), the host
    clock elsewhere."""

    def __init__(self, device: torch.device):
        self.device, self.cuda = device, device.type == "cuda"

    def __call__(self, work) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            work()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        began = time.perf_counter()
        work()
        return time.perf_counter() - began


def build_models(sizes: dict, device: torch.device, dtype: torch.dtype, max_positions: int):
    """The random target and drafter, built directly on `device` in `dtype`."""
    shared = dict(
        vocab_size=sizes["vocab"],
        max_position_embeddings=max_positions,
        rope_theta=5e5,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    models = []
    for name in ("target", "drafter"):
        config = LlamaConfig(**sizes[name], **shared)
        with torch.device(device):
            models.append(LlamaForCausalLM._from_config(config, dtype=dtype).eval())
    return models


def step_seconds(
    timer: DeviceTimer, forward, cache, context: int, tokens: int, repeats: int, inner: int = 1
) -> float:
    """Median seconds of forwarding `tokens` tokens at position `context`; with `inner` > 1 (one token), the
    median step of `inner` consecutive positions, as decoding runs them. The cache is rolled back after each."""
    device = timer.device
    ids = torch.full((1, tokens), 7, device=device)

    def work():
        for step in range(inner):
            position = context + step * tokens
            positions = torch.arange(position, position + tokens, device=device)[None]
            forward(input_ids=ids, position_ids=positions, cache=cache, use_cache=True, logits_to_keep=1)
        cache.crop(-tokens * inner)

    work()  # warm-up (and, for a compiled step, its compilation)
    return statistics.median(timer(work) / inner for _ in range(repeats))


def target_costs(target, prompt, sizes: dict, timer: DeviceTimer) -> dict:
    """The target's one-token step on transformers' `DynamicCache` and its verification curve (n = 1 ...) on a
    `GrowableCache`, with its own `sdpa` and with the one-liner's `budgetdraft_sdpa` (`verify_s`), seconds."""
    context = prompt.shape[1]
    out = {}
    with torch.inference_mode():
        stock = DynamicCache(config=target.config)
        target(prompt, cache=stock, use_cache=True, logits_to_keep=1)
        out["step_stock_s"] = step_seconds(timer, target.forward, stock, context, 1, sizes["repeats"], 2)
        del stock
        fast = GrowableCache(config=target.config, initial_capacity=context + sizes["max_verify"] + 1)
        target(prompt, cache=fast, use_cache=True, logits_to_keep=1)
        for key, attention in (("verify_sdpa_s", None), ("verify_s", FAST_SDPA)):
            with using_attention(target, attention):
                out[key] = [
                    step_seconds(timer, target.forward, fast, context, n, sizes["repeats"], 1)
                    for n in range(1, sizes["max_verify"] + 1)
                ]
    out["step_fast_s"] = out["verify_s"][0]
    return out


def draft_variants(drafter, varlen_drafter, sizes: dict, context: int, compile_modes: dict) -> dict:
    """name -> (model, forward, cache factory): the drafter's one-token step on each draft cache, eager and under
    each compile mode."""
    slack = sizes["steps"] + 8
    sink, budgeted = sizes["caches"]["sink_window"], sizes["caches"]["budgeted"]
    config, varlen_config = drafter.config, varlen_drafter.config
    caches = {
        "full": (drafter, lambda: DynamicCache(config=config)),
        "full_static": (drafter, lambda: StaticCache(config, max_cache_len=context + slack)),
        "sink_window": (drafter, lambda: SinkWindowCache(config, **sink, slack=slack)),
        "sink_window_static": (
            varlen_drafter,
            lambda: SinkWindowCache(varlen_config, **sink, slack=slack, static=True),
        ),
        "budgeted": (drafter, lambda: BudgetedCache(config, **budgeted, slack=slack)),
        "budgeted_static": (
            varlen_drafter,
            lambda: BudgetedCache(varlen_config, **budgeted, slack=slack, static=True),
        ),
    }
    variants = {}
    for name, (model, make_cache) in caches.items():
        if name != "full_static":
            variants[f"{name}_eager"] = (model, model.forward, make_cache)
        if name.endswith("static"):
            for mode, kwargs in compile_modes.items():
                label = name.replace("full_static", "full")
                variants[f"{label}_compiled{mode}"] = (
                    model,
                    torch.compile(model.forward, **kwargs),
                    make_cache,
                )
    return variants


def compile_modes(smoke: bool) -> dict:
    """Compile settings to time, by suffix: `reduce-overhead` (CUDA graphs with inductor's graph partitions) and
    CUDA graphs over the unpartitioned graph (the package's CUDA default, `draft_step_compile_config`)."""
    if smoke:
        return {"": dict(fullgraph=True, dynamic=False, backend="eager")}
    return {
        "": dict(fullgraph=True, dynamic=False, mode="reduce-overhead"),
        "_no_partition": dict(
            fullgraph=True, dynamic=False, options={"triton.cudagraphs": True, "graph_partition": False}
        ),
    }


def drafter_costs(drafter, varlen_drafter, prompt, sizes: dict, timer: DeviceTimer, modes: dict) -> dict:
    """The drafter's one-token step (seconds, over consecutive positions) on each draft cache, each compile's
    seconds, and failures (after one, the compiler's CUDA-graph state is reset so the next variant starts clean)."""
    context = prompt.shape[1]
    steps, compile_s, errors = {}, {}, {}
    for name, (model, forward, make_cache) in draft_variants(
        drafter, varlen_drafter, sizes, context, modes
    ).items():
        try:
            with torch.inference_mode():
                cache = make_cache()
                model(prompt, cache=cache, use_cache=True, logits_to_keep=1)
                if "compiled" in name:
                    began = time.perf_counter()
                    step_seconds(timer, forward, cache, context, 1, 1)
                    compile_s[name] = time.perf_counter() - began
                steps[name] = step_seconds(
                    timer, forward, cache, context, 1, sizes["repeats"], sizes["steps"]
                )
        except Exception as error:  # one broken variant must not hide the others' timings
            errors[name] = f"{error!r}\n{traceback.format_exc()}"
            reset_compiler(timer.device)
    return {"step_s": steps, "compile_s": compile_s, "errors": errors}


def reset_compiler(device: torch.device) -> None:
    torch._dynamo.reset()
    if device.type == "cuda":
        from torch._inductor import cudagraph_trees

        cudagraph_trees.reset_cudagraph_trees()


def oneliner_costs(target, drafter, prompt, sizes: dict, measured: dict) -> dict:
    """Plain `generate()` against the one-liner (a fixed γ, and its defaults), decode seconds a token, paired
    repeats; a round's host time = its wall time minus the device time of its forwards (an estimate)."""
    new, gamma = sizes["new_tokens"], sizes["gamma"]
    calls = {
        "ar_stock": dict(),
        "oneliner_fixed": dict(assistant_model=drafter, spec=DraftSpec(draft_length=gamma)),
        "oneliner_default": dict(assistant_model=drafter, spec=DraftSpec()),
    }
    per_token, rounds, plans = {name: [] for name in calls}, {}, {}
    for repeat in range(sizes["oneliner_repeats"] + 1):  # the first pass warms every path
        for name, kwargs in calls.items():
            result = timed_generate(target, prompt, new, seed=repeat, **kwargs)
            if repeat:
                per_token[name].append(1.0 / result.decode_tokens_per_second)
            if result.stats.rounds:
                rounds[name] = result.stats.mean_accepted_length
                plans[name] = describe_plan(result.stats.plan)
    seconds = {name: statistics.median(values) for name, values in per_token.items()}
    fixed_round = seconds["oneliner_fixed"] * rounds["oneliner_fixed"]
    used = draft_step_used(plans.get("oneliner_fixed"), measured["draft_step_s"])
    fixed_round_device = measured["verify_s"][gamma] + gamma * used
    return {
        "context": prompt.shape[1],
        "new_tokens": new,
        "decode_s_per_token": seconds,
        "runs_s_per_token": per_token,
        "tokens_per_round": rounds,
        "plans": plans,
        "ar_host_s_per_token": seconds["ar_stock"] - measured["step_stock_s"],
        "fixed_gamma": gamma,
        "fixed_round_s": fixed_round,
        "fixed_round_device_s": fixed_round_device,
        "host_s_per_round": fixed_round - fixed_round_device,
        "default_over_plain": seconds["ar_stock"] / seconds["oneliner_default"],
    }


def synchronisations(target, prompt, sizes: dict, **kwargs) -> dict | None:
    """CUDA synchronisations a decoding step or round costs, counted by torch's sync debug mode (CUDA only):
    transformers' own (the acceptance, stopping criteria) and anything the package adds."""
    if prompt.device.type != "cuda":
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = timed_generate(target, prompt, sizes["new_tokens"], **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    count = sum("synchroniz" in str(w.message) for w in caught)
    rounds = result.stats.rounds or len(result.new_ids)
    return {"synchronisations": count, "rounds_or_tokens": rounds, "per_round": count / rounds}


def describe_plan(plan) -> dict | None:
    if plan is None:
        return None
    spec = plan.spec
    return {
        "static": spec.static,
        "lean_step": spec.lean_step,
        "compile": spec.compile,
        "draft_length": spec.draft_length,
        "draft_attention": plan.draft_attention,
        "target_attention": plan.target_attention,
        "target_linear": plan.target_linear,
        "prefill_window": spec.prefill_window,
        "reasons": plan.reasons,
    }


def draft_step_used(plan: dict | None, steps: dict) -> float:
    """The draft-step cost of the variant a one-liner plan ran (the lean step is timed as the static eager step)."""
    if plan and plan["static"]:
        name = "budgeted_static_compiled" if plan["compile"] else "budgeted_static_eager"
    else:
        name = "budgeted_eager"
    return steps.get(name, steps.get("budgeted_eager", 0.0))


def cost_curves(report, device: torch.device, sizes: dict, smoke: bool) -> dict:
    """The section: per-context costs, the one-liner at the first context, the speed-up table. Partial results
    are written into the report as each part finishes."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    modes = compile_modes(smoke)
    target, drafter = build_models(sizes, device, dtype, max(sizes["contexts"]) + 256)
    varlen_drafter = copy.deepcopy(drafter)
    varlen_drafter.set_attn_implementation(VARLEN)
    timer = DeviceTimer(device)
    result = {
        "models": {
            "target_params": target.num_parameters(),
            "drafter_params": drafter.num_parameters(),
            "dtype": str(dtype),
        },
        "contexts": [],
        "speedup": [],
    }
    report.data["cost_curves"] = result
    torch._dynamo.reset()
    for context in sizes["contexts"]:
        if report.time_left() < 45 and not smoke:
            report.skip(f"cost_curves.{context}", "time budget")
            continue
        prompt = torch.randint(0, sizes["vocab"], (1, context), device=device)
        costs = {"context": context, **target_costs(target, prompt, sizes, timer)}
        draft = drafter_costs(drafter, varlen_drafter, prompt, sizes, timer, modes)
        costs.update(draft_step_s=draft["step_s"], compile_s=draft["compile_s"], errors=draft["errors"])
        for name, error in draft["errors"].items():
            report.check(f"cost_curves.{context}.{name}.ran", False, error.splitlines()[0])
        result["contexts"].append(costs)
        print(
            f"  context {context}: target step {1e3 * costs['step_fast_s']:.2f} ms (stock "
            f"{1e3 * costs['step_stock_s']:.2f}), verify 5 {1e3 * costs['verify_s'][4]:.2f} ms; draft steps "
            + ", ".join(f"{n} {1e3 * t:.3f}" for n, t in costs["draft_step_s"].items())
            + " ms",
            flush=True,
        )
        if context == sizes["contexts"][0]:
            result["oneliner"] = oneliner_part(report, target, drafter, prompt, sizes, costs)
        host = result.get("oneliner", {}).get("host_s_per_round", 0.0)
        result["speedup"] += speedups(context, costs, max(host, 0.0))
        report.write()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    report.check("cost_curves.measured", bool(result["contexts"]), f"{len(result['contexts'])} contexts")
    return result


def oneliner_part(report, target, drafter, prompt, sizes: dict, costs: dict) -> dict:
    try:
        oneliner = oneliner_costs(target, drafter, prompt, sizes, costs)
    except Exception as error:
        report.check("cost_curves.oneliner.ran", False, repr(error))
        return {"error": f"{error!r}\n{traceback.format_exc()}"}
    gamma_spec = DraftSpec(draft_length=sizes["gamma"])
    oneliner["synchronisations"] = {
        "plain_generate": synchronisations(target, prompt, sizes),
        "oneliner_fixed": synchronisations(target, prompt, sizes, assistant_model=drafter, spec=gamma_spec),
    }
    print(
        f"  one-liner at {prompt.shape[1]}: plain {1e3 * oneliner['decode_s_per_token']['ar_stock']:.2f} ms/token, "
        f"default one-liner {oneliner['default_over_plain']:.2f}x plain, host a round "
        f"{1e3 * oneliner['host_s_per_round']:.2f} ms (estimate)",
        flush=True,
    )
    return oneliner
