"""The rows of `gpu_round.py`: random models, the timed calls (a) ... (d0), replayed acceptance, the device round's
own record (what ran, synchronisations, host time a round) and the checks and goals."""

from __future__ import annotations

import contextlib
import copy
import platform
import statistics
import time
import warnings

import gpu_cost_curves
import torch
import transformers
from transformers import CompileConfig
from transformers.generation.streamers import BaseStreamer

import hf_budgetdraft
from hf_budgetdraft import record_speculation
from hf_budgetdraft.eval.replay import ReplayedAcceptance, divergence
from hf_budgetdraft.generation.compiled_step import cuda_graph_skips_so_far
from hf_budgetdraft.generation.device_loop import DeviceRound
from hf_budgetdraft.generation.draft_length.clock import synchronize
from hf_budgetdraft.generation.draft_steps import DraftSteps
from hf_budgetdraft.generation.static_verify import StaticVerify
from hf_budgetdraft.runs.timed_call import configure_drafter
from hf_budgetdraft.runs.token_diff import divergence_margin, tie_tolerance

MAX_REANCHORS = 3  # re-anchorings of the reference per row and trace before the row is reported diverged


def smoke_one_liner() -> dict:
    """The CPU smoke's one-liner settings, fresh each call: the device round and its compiled steps are CUDA rules,
    forced here, compiled without inductor."""
    return {
        "cache_config": {"device_round": True, "compile_verify": True, "compile": True},
        "compile_config": CompileConfig(fullgraph=True, dynamic=False, backend="eager", mode=None),
    }


def environment(device: torch.device) -> dict:
    info = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "hf_budgetdraft": hf_budgetdraft.__version__,
        "python": platform.python_version(),
        "device": str(device),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def random_models(sizes: dict, device: torch.device, dtype: torch.dtype, context: int):
    """The random target and drafter (`gpu_cost_curves.build_models`), room for the call and its longest round."""
    positions = context + 2 * sizes["new_tokens"] + 64
    return gpu_cost_curves.build_models(sizes["models"], device, dtype, positions)


@torch.inference_mode()
def sharpen(target, prompt, logit_scale: float) -> dict:
    """Scale the LM head so the target's logits spread over about `logit_scale` (random weights give logits near
    0, where bf16 rounding flips the argmax); the smallest top-1 margin over the prompt's last 256 positions."""
    head = target.get_output_embeddings().weight
    probe = prompt[:, -256:]
    logits = target(input_ids=probe).logits[0].float()
    head.mul_(logit_scale / max(float(logits.std()), 1e-6))
    logits = target(input_ids=probe).logits[0].float()
    top = logits.topk(2, dim=-1).values
    margins = top[:, 0] - top[:, 1]
    return {
        "scale_to_std": logit_scale,
        "smallest_top1_margin": float(margins.min()),
        "median_top1_margin": float(margins.median()),
        "bf16_tie_tolerance": tie_tolerance(torch.bfloat16),
    }


def _timed(target, prompt, new_tokens: int, kwargs: dict) -> tuple[float, torch.Tensor, object]:
    synchronize(prompt.device)
    with record_speculation() as stats:
        began = time.perf_counter()
        out = target.generate(prompt, do_sample=False, max_new_tokens=new_tokens, **kwargs)
        synchronize(prompt.device)
        seconds = time.perf_counter() - began
    return seconds, out, stats


class FirstTokens(BaseStreamer):
    """A streamer that notes when a call's first generated tokens reach the host, and how many: `generate()` puts
    the prompt, then each loop its tokens through a synchronising `.cpu()` (transformers' loops and the device
    round alike), so the second `put` marks the end of the prefill and the first token."""

    def __init__(self):
        self.puts, self.at, self.tokens = 0, None, 0

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == 2:
            self.at, self.tokens = time.perf_counter(), value.numel()

    def end(self) -> None:
        pass


def decode_rate(target, prompt, new_tokens: int, kwargs: dict, replay: ReplayedAcceptance | None, seed: int):
    """`(decode tokens/s after the first streamed tokens, output, stats)`, replayed if asked: one call, timed from
    its first token (stock assisted generation streams its whole first round, prefill included, so its rate starts
    after that round) to its end. A difference of two calls, t(N) - t(1), would subtract two prefills that dwarf
    the decoding at 128K and double the device time."""
    if replay is not None:
        replay.reseed(seed)
    clock = FirstTokens()
    with replay.installed() if replay is not None else contextlib.nullcontext():
        _, out, stats = _timed(target, prompt, new_tokens, {**kwargs, "streamer": clock})
        ended = time.perf_counter()
    after_first = out.shape[1] - prompt.shape[1] - clock.tokens
    return after_first / max(ended - clock.at, 1e-9), out, stats


def row_calls(target, drafter, sizes: dict, full: bool) -> dict:
    """name -> (generate() kwargs, replayed?): (a) ... (d0); `full=False`: (b) and (d) only."""
    one_liner = {"assistant_model": drafter, "cache_implementation": "budgeted"}
    if sizes.get("force_round"):
        one_liner.update(smoke_one_liner())
    calls = {
        "b_static_compiled": ({"cache_implementation": "static"}, False),
        "d_oneliner": (one_liner, True),
    }
    if not full:
        return calls
    stock = copy.deepcopy(drafter)  # transformers' defaults, as loaded
    zero = copy.deepcopy(one_liner)
    zero["cache_config"] = {**zero.get("cache_config", {}), "draft_length": 0}
    calls.update(
        a_plain=({}, False),
        c_stock_default=({"assistant_model": stock, "cache_implementation": "static"}, True),
        c_stock_gamma=({"assistant_model": copy.deepcopy(drafter), "cache_implementation": "static"}, True),
        d0_oneliner_no_draft=(zero, False),
    )
    return calls


def _reference(target, prompt, length: int) -> torch.Tensor:
    """The target's greedy continuation on (b)'s path, `length` new tokens (untimed)."""
    return target.generate(prompt, do_sample=False, max_new_tokens=length, cache_implementation="static")


def _measure(target, prompt, sizes, name, kwargs, replay, seed, judged: dict) -> float:
    """One timed row; a divergence from the reference re-anchors it (untimed, counted) and the row is re-run."""
    for _ in range(MAX_REANCHORS + 1):
        rate, out, stats = decode_rate(target, prompt, sizes["new_tokens"], kwargs, replay, seed)
        at = divergence(out, judged["reference"], prompt.shape[1])
        if at is None:
            judged.setdefault("runtime", {})[name] = stats.runtime
            judged.setdefault("proposed", {})[name] = stats.proposed_per_round[1:]
            judged.setdefault("tokens_a_round", {})[name] = (
                stats.mean_accepted_length if stats.rounds else None
            )
            return rate
        margin = divergence_margin(
            target,
            prompt,
            judged["reference"][0, prompt.shape[1] :],
            out[0, prompt.shape[1] :],
            at - prompt.shape[1],
        )
        judged.setdefault("divergences", []).append({"row": name, "position": at, "target_margin": margin})
        extra = judged["reference"].shape[1] - at - 1
        judged["reference"] = _reference(target, out[:, : at + 1], extra)
        if replay is not None:
            replay.reference = judged["reference"]
    judged.setdefault("unresolved", []).append(name)
    return rate


def compare(report, target, drafter, prompt, sizes: dict, traces: dict, full: bool) -> dict:
    """Every row, paired repeats, each trace; ratios to (b) per repeat, medians; the device round's record."""
    calls = row_calls(target, drafter, sizes, full)
    extra = sizes["new_tokens"] + sizes["trace_depth"] + 2
    judged = {"reference": _reference(target, prompt, extra)}
    compile_seconds = {}
    warm_replay = ReplayedAcceptance(
        judged["reference"], next(iter(traces.values())), sizes["models"]["vocab"]
    )
    for name, (kwargs, replayed) in calls.items():  # the warm pass: compilations and captures, timed apart
        # replayed rows warm with the rounds they will time (a stock loop compiles each verification length)
        with warm_replay.installed() if replayed else contextlib.nullcontext():
            streamed = {**kwargs, "streamer": FirstTokens()}  # as the timed calls run
            cold, _, cold_stats = _timed(target, prompt, sizes["new_tokens"], streamed)
            warm, _, _ = _timed(target, prompt, sizes["new_tokens"], streamed)
        compile_seconds[name] = round(cold - warm, 3)
        judged.setdefault("cold_runtime", {})[name] = cold_stats.runtime
    rates = {}
    for repeat in range(sizes["repeats"]):
        for trace_name, trace in traces.items():
            replay = ReplayedAcceptance(judged["reference"], trace, sizes["models"]["vocab"])
            for name, (kwargs, replayed) in calls.items():
                if name == "c_stock_gamma":
                    gamma = _typical_gamma(judged, trace_name)
                    configure_drafter(kwargs["assistant_model"], gamma)
                key = f"{name} | {trace_name}" if replayed else name
                if not replayed and trace_name != next(iter(traces)):
                    continue
                rate = _measure(
                    target, prompt, sizes, key, kwargs, replay if replayed else None, repeat, judged
                )
                rates.setdefault(key, []).append(rate)
    result = _summarise(rates, judged, compile_seconds, traces)
    result["round"] = device_round_record(target, prompt, sizes, calls["d_oneliner"][0], judged, traces)
    return result


def _typical_gamma(judged: dict, trace_name: str) -> int:
    """The one-liner's median drafted length in its drafting rounds with this trace (measured before (c) in each
    repeat)."""
    drafted = [p for p in judged["proposed"][f"d_oneliner | {trace_name}"] if p]
    return max(1, round(statistics.median(drafted))) if drafted else 1


def _summarise(rates: dict, judged: dict, compile_seconds: dict, traces: dict) -> dict:
    b = rates["b_static_compiled"]
    ratios = {}
    for key, values in rates.items():
        pairs = [v / b[i] for i, v in enumerate(values)]  # one value a repeat, paired with (b)'s
        ratios[key] = statistics.median(pairs)
    return {
        "decode_tokens_per_s": {k: statistics.median(v) for k, v in rates.items()},
        "runs_tokens_per_s": rates,
        "ratio_to_b": ratios,
        "compile_and_capture_s": compile_seconds,
        # what the compiling calls ran (the one-liner's graphs compile there), and the process's CUDA-graph skips
        "cold_runtime": judged.get("cold_runtime", {}),
        "cuda_graph_skips_in_process": cuda_graph_skips_so_far(),
        "tokens_a_round": judged.get("tokens_a_round", {}),
        "runtime": judged.get("runtime", {}),
        "divergences": judged.get("divergences", []),
        "unresolved_divergences": judged.get("unresolved", []),
        "traces": traces,
        "replay": "replayed acceptance (hf_budgetdraft.eval.replay): random weights, proposals set from each trace",
    }


class ForwardSpans:
    """Times every verification and draft forward of the device round with CUDA events (host clock on CPU),
    grouped by round: a round's wall time minus its forwards' device time is its exposed host time."""

    def __init__(self, device: torch.device):
        self.cuda, self.rounds = device.type == "cuda", []

    def _mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _wrap(self, function):
        spans = self

        def timed(*args, **kwargs):
            begin = spans._mark()
            out = function(*args, **kwargs)
            if spans.rounds:
                spans.rounds[-1].append((begin, spans._mark()))
            return out

        return timed

    @contextlib.contextmanager
    def installed(self):
        originals = (StaticVerify.__call__, DraftSteps.__call__, DeviceRound._round)
        spans = self

        def round_(round_self, *args, **kwargs):
            spans.rounds.append([])
            return originals[2](round_self, *args, **kwargs)

        StaticVerify.__call__, DraftSteps.__call__ = self._wrap(originals[0]), self._wrap(originals[1])
        DeviceRound._round = round_
        try:
            yield self
        finally:
            StaticVerify.__call__, DraftSteps.__call__, DeviceRound._round = originals

    def device_seconds(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [sum(b.elapsed_time(e) / 1e3 for b, e in spans) for spans in self.rounds]
        return [sum(e - b for b, e in spans) for spans in self.rounds]

    def summary(self, stats) -> dict:
        """Medians over the call's rounds after the first (which holds the prefills): the exposed host ms of a
        drafting round (its wall time, from `stats`, minus its forwards' device time) and a round's device ms."""
        device = self.device_seconds()
        walls = [
            d + v for d, v in zip(stats.draft_seconds_per_round, stats.verify_seconds_per_round, strict=True)
        ]
        drafted = stats.proposed_per_round
        host = [w - d for w, d, p in zip(walls[1:], device[1:], drafted[1:], strict=False) if p]
        return {
            "host_ms_per_drafting_round": statistics.median(host) * 1e3 if host else None,
            "device_ms_per_round": statistics.median(device[1:]) * 1e3 if len(device) > 1 else None,
        }


def device_round_record(target, prompt, sizes: dict, kwargs: dict, judged: dict, traces: dict) -> dict:
    """The one-liner's own record with the first trace: exposed host ms a drafting round, synchronisations a round."""
    trace = next(iter(traces.values()))
    replay = ReplayedAcceptance(judged["reference"], trace, sizes["models"]["vocab"])
    spans = ForwardSpans(prompt.device)
    with replay.installed(), spans.installed():
        _, _, stats = _timed(target, prompt, sizes["new_tokens"], kwargs)
    record = {
        "rounds": stats.rounds,
        "drafting_rounds": stats.rounds - stats.ar_rounds,
        **spans.summary(stats),
        "runtime": stats.runtime,
        "synchronisations_per_round": synchronisations(target, prompt, sizes, kwargs, replay),
        "host_attribution": host_attribution(target, prompt, sizes, kwargs, replay),
    }
    return record


# profiler events of a compiled call's host time: dynamo's guard check before it, and the compiled region itself
# (on CUDA its CUDA-graph replay and input copies)
HOST_EVENTS = {"dynamo_guard_check": "TorchDynamo Cache Lookup", "compiled_regions": "Torch-Compiled Region"}


def host_attribution(target, prompt, sizes: dict, kwargs: dict, replay) -> dict:
    """Where a round's host time goes, from one more call under the CPU profiler (its overhead included: an
    attribution, not a timing): µs a round and calls a round in dynamo's guard checks and in compiled regions."""
    replay.reseed(0)
    with replay.installed(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _, _, stats = _timed(target, prompt, sizes["new_tokens"], kwargs)
    rounds, out = max(stats.rounds, 1), {"rounds": stats.rounds}
    events = prof.key_averages()
    for name, prefix in HOST_EVENTS.items():
        matched = [e for e in events if e.key.startswith(prefix)]
        out[f"{name}_us_per_round"] = sum(e.cpu_time_total for e in matched) / rounds
        out[f"{name}_calls_per_round"] = sum(e.count for e in matched) / rounds
    return out


def synchronisations(target, prompt, sizes: dict, kwargs: dict, replay) -> float | None:
    """Synchronisations a round on CUDA, seen by torch's sync debug mode (transformers' code and C++ ops too): the
    difference between a call of N and of 2N tokens, over the difference in rounds (the per-call ones cancel)."""
    if prompt.device.type != "cuda":
        return None
    counts = []
    for tokens in (sizes["new_tokens"], 2 * sizes["new_tokens"]):
        replay.reseed(0)
        with warnings.catch_warnings(record=True) as caught, replay.installed():
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                _, _, stats = _timed(target, prompt, tokens, kwargs)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        counts.append((sum("synchroniz" in str(w.message) for w in caught), stats.rounds))
    (s1, r1), (s2, r2) = counts
    return (s2 - s1) / max(r2 - r1, 1)


def compiled_steps_ran(runtime: dict, drafting_rounds: int) -> bool:
    """Both compiled steps of a device-round call ran, not only were planned, and neither failed: the verification,
    and the draft step wherever the call drafted (a call that never drafted runs no draft step)."""
    verify, draft = runtime.get("verify") or {}, runtime.get("draft_step") or {}
    draft_ran = draft.get("compiled") and (draft.get("compiled_calls", 0) > 0 or not drafting_rounds)
    return bool(
        verify.get("compiled_calls", 0) > 0
        and draft_ran
        and not verify.get("failure")
        and not draft.get("failure")
    )


def judge(report, result: dict, name: str, goal: float | None) -> None:
    """The device round's must-holds as checks; the speed goals reported in `result["goals"]`."""
    record = result["round"]
    runtime = record["runtime"] or {}
    on_gpu = result["device"] == "cuda"
    report.check(f"{name}.device_round_ran", runtime.get("loop") == "device_round", runtime)
    report.check(
        f"{name}.compiled_ran",
        compiled_steps_ran(runtime, record["drafting_rounds"]),
        {**runtime, "drafting_rounds": record["drafting_rounds"]},
    )
    warm = [r for r in result["runtime"].values() if (r or {}).get("loop") == "device_round"]
    verifies, drafts = [r.get("verify") or {} for r in warm], [r.get("draft_step") or {} for r in warm]
    report.check(
        f"{name}.no_recompiles",
        all(v.get("new_shapes", 0) == v.get("recompiles", 0) == 0 for v in verifies)
        and all(d.get("graphs_compiled", 0) == d.get("recompiles", 0) == 0 for d in drafts),
        {"verify": verifies, "draft_step": drafts},
    )
    ratios = result["ratio_to_b"]
    if on_gpu:  # timings: checked on the GPU only (the CPU smoke's tiny models measure nothing)
        cold = [r for r in result["cold_runtime"].values() if (r or {}).get("loop") == "device_round"]
        report.check(
            f"{name}.cuda_graphs",
            bool(cold)
            and all(
                (r.get("verify") or {}).get("cuda_graph_skips", 0) == 0
                and (r.get("draft_step") or {}).get("cuda_graph_skips", 0) == 0
                for r in cold
            ),
            cold,
        )
        report.check(f"{name}.one_sync_a_round", (record["synchronisations_per_round"] or 99) <= 1.05, record)
        report.check(f"{name}.host_ms", (record["host_ms_per_drafting_round"] or 99) <= 1.0, record)
        if "d0_oneliner_no_draft" in ratios:
            report.check(f"{name}.ar_round_vs_b", ratios["d0_oneliner_no_draft"] >= 1 / 1.05, ratios)
    report.check(f"{name}.outputs", not result["unresolved_divergences"], result["divergences"])
    result["goals"] = goals(ratios, goal)


def goals(ratios: dict, goal: float | None) -> dict:
    """(d) over (b) with each bundled trace against `goal`, over (c) by 1.3, never under 0.95 (b)."""
    out = {}
    for key, ratio in ratios.items():
        if not key.startswith("d_oneliner | "):
            continue
        trace = key.split(" | ", 1)[1]
        row = {"d_over_b": ratio, "never_below_0.95": ratio >= 0.95}
        if goal is not None and not trace.startswith("paper"):
            row["goal_d_over_b"], row["met"] = goal, ratio >= goal
        stock = [ratios.get(f"{c} | {trace}") for c in ("c_stock_default", "c_stock_gamma")]
        stock = [s for s in stock if s is not None]
        if stock:
            row["d_over_best_c"] = ratio / max(stock)
            row["met_over_c"] = row["d_over_best_c"] >= 1.3
        else:
            row["d_over_best_c"] = "not measured"
        out[trace] = row
    return out
