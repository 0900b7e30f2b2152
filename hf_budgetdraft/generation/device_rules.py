"""The fast path's choices that depend on the device: one pure function from (device type, dtype) to what runs.

Every automatic choice of a `DraftPlan` that differs between devices is decided here, each with its reason, which
`stats.plan.reasons` reports: `measured` where a benchmark on such a device decided it (`docs/gpu.md`,
`docs/results.md`), `estimate` where nothing measured it yet.

- CPU: the CPU speed-ups on (the lean draft step, few-row linear layers for a float32 target, the windowed draft
  prefill); the compiled draft step once it pays for its compilation (ski rental); rounds timed on the host clock.
- CUDA: the CPU speed-ups off; the CUDA-graph draft step from the first call where the drafter allows it; rounds
  timed with CUDA events read after the acceptance's own synchronisation (none added).
- Other accelerators: the CPU speed-ups off, the compiled step once it pays, rounds synchronised and host-timed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_CPU_SPEEDUP = "estimate: a CPU speed-up (it saves per-module Python and thread hand-offs, not device work)"


@dataclass(frozen=True)
class DeviceRules:
    """What runs by default on one kind of device, each field with a reason in `reasons`.

    Attributes:
        device_type (`str`): `"cpu"`, `"cuda"`, ...
        lean_step (`bool`): `"auto"` may turn the lean draft step on.
        few_row_linear (`bool`): a float32 target's linear layers may run as few-row GEMMs.
        prefill_window (`bool`): `"auto"` may prefill the drafter in windowed chunks.
        compile_from_first_call (`bool`): `"auto"` compiles a static draft cache's step at once (else once it pays).
        device_round (`bool`): `"auto"` runs the device round: a static target cache, verification compiled.
        coarse_verify_buckets (`bool`): the device round compiles its verification for two lengths (1 and the
            call's longest round), not for 1, 2, 4, ... up to the longest (`static_verify.buckets`).
        compiled_catch_up (`int`): a draft block of up to this many tokens runs through a compiled one-token step,
            one token at a time, rather than one eager forward (0: never).
        round_clock (`str`): `"events"` (device events read after the acceptance) or `"host"` (synchronised).
        reasons (`dict[str, str]`): why, per field.
    """

    device_type: str
    lean_step: bool
    few_row_linear: bool
    prefill_window: bool
    compile_from_first_call: bool
    device_round: bool
    coarse_verify_buckets: bool
    compiled_catch_up: int
    round_clock: str
    reasons: dict


def device_rules(device: torch.device | str, dtype: torch.dtype = torch.float32) -> DeviceRules:
    """The rules for a drafter (and target) on `device` in `dtype`."""
    kind = torch.device(device).type
    if kind == "cpu":
        return DeviceRules(
            device_type="cpu",
            lean_step=True,
            few_row_linear=dtype == torch.float32,
            prefill_window=True,
            compile_from_first_call=False,
            device_round=False,
            coarse_verify_buckets=False,
            compiled_catch_up=0,
            round_clock="host",
            reasons={
                "lean_step": "measured on CPU: a lean step costs less than the drafter's own forward",
                "few_row_linear": "measured on CPU: few-row GEMMs use every thread for a float32 verification"
                if dtype == torch.float32
                else f"off for {dtype}: the few-row GEMMs are float32 kernels",
                "prefill_window": "measured on CPU: a windowed draft prefill costs less than a full one",
                "compile_from_first_call": "measured on CPU: a cold compilation costs about 20-25 s and the "
                "compiled step saves about half an eager step, a third of a lean one, so the step compiles once the "
                "uncompiled steps have spent what it would have saved (ski rental)",
                "device_round": "measured on CPU, the verification eager or compiled: slower than the CPU round, "
                "whose target keeps budgetdraft_sdpa and few-row linear layers on a GrowableCache",
                "coarse_verify_buckets": "estimate: a CPU verification costs in proportion to its tokens, so a "
                "round is padded to at most twice its length",
                "compiled_catch_up": "estimate: on CPU catch-up blocks keep the block step (the lean step's, measured "
                "cheaper than the drafter's own forward)",
                "round_clock": "host clock: CPU work is synchronous",
            },
        )
    cuda = kind == "cuda"
    return DeviceRules(
        device_type=kind,
        lean_step=False,
        few_row_linear=False,
        prefill_window=False,
        compile_from_first_call=cuda,
        device_round=cuda,
        coarse_verify_buckets=cuda,
        compiled_catch_up=4 if cuda else 0,
        round_clock="events" if cuda else "host",
        reasons={
            "lean_step": _CPU_SPEEDUP,
            "few_row_linear": _CPU_SPEEDUP,
            "prefill_window": _CPU_SPEEDUP,
            "compile_from_first_call": "measured on an H200: the CUDA-graph draft step compiles in seconds and "
            "runs several times faster than the eager step"
            if cuda
            else "estimate: no measurement on this device; the step compiles once it pays",
            "compiled_catch_up": "estimate from H200 step costs: a compiled one-token draft step (0.2-0.4 ms) costs "
            "a fraction of an eager block forward (1.9-3.5 ms), so up to 4 catch-up tokens go one at a time"
            if cuda
            else "estimate: no measurement on this device",
            "device_round": "estimate: eager transformers is host-bound on an H200 (an 8B step 21-42 ms against "
            "~3.3 ms of weight reads), so the round runs as compiled device work with one host read"
            if cuda
            else "estimate: no measurement on this device; transformers' loop",
            "coarse_verify_buckets": "estimate: a verification of up to a few tens of tokens reads the same "
            "weights as a one-token step, so padding costs little, and each length is a compilation and CUDA-graph "
            "capture of the whole target"
            if cuda
            else "estimate: no measurement on this device; padded to at most twice a round's length",
            "round_clock": "CUDA events read after the acceptance's own synchronisation"
            if cuda
            else "host clock after a device synchronisation",
        },
    )
