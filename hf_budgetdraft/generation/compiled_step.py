"""The compiled one-token draft step: how it compiles (`draft_step_compile_config`), where the device rules
rent before they buy, when its compilation pays (`compile_pays`), what a compiled step that cannot compile again
raises (`compiling_again_failed`), and how many graphs the process has compiled (`dynamo_graphs_so_far`) and run
without the CUDA graphs they asked for (`cuda_graph_skips_so_far`).

On CPU a compilation costs seconds to tens of seconds and a step saves a fraction of a millisecond, so `"auto"`
compiles once this process has spent `COMPILE_SECONDS_ESTIMATE / COMPILED_STEP_SAVING` seconds in eager static
draft steps of that drafter (ski rental), and reuses a step compiled earlier in the process at once. The rent is the
drafter's entry in `model_state.py` (keyed weakly by the drafter: a drafter that is dropped takes it along, a copy
starts from nothing).
"""

from __future__ import annotations

import functools

import torch
from transformers import CompileConfig

from .compiled_call import has_compiled_call
from .model_state import model_state

# a cold inductor compilation of a small drafter's step on CPU, rounded up from what benchmarks/results records
COMPILE_SECONDS_ESTIMATE = 30.0
# share of a static step a compiled one saves: of the drafter's own eager forward, of a lean step (the smallest
# recorded; benchmarks/draft_step_cost.py measures both)
COMPILED_STEP_SAVING = {"eager": 0.5, "lean": 0.35}


def draft_step_compile_config(device: torch.device | str) -> CompileConfig:
    """How to compile a static draft cache's one-token step (set it as `drafter.generation_config.compile_config`).

    One graph of fixed shapes (`dynamic=False`) for the whole generation. CUDA: one whole graph replayed as a CUDA
    graph (`reduce-overhead`'s `triton.cudagraphs`) without inductor's graph partitions, whose generated code
    failed on torch 2.11 for this step while the unpartitioned graph ran (`docs/gpu.md`). Elsewhere: inductor
    with its C++ wrapper, which calls the generated kernels from C++ instead of a Python wrapper; for a small
    drafter the step is mostly that overhead. The C++ wrapper makes the first compilation slower.
    """
    if torch.device(device).type == "cuda":
        return CompileConfig(
            fullgraph=True,
            dynamic=False,
            mode=None,
            options={"triton.cudagraphs": True, "graph_partition": False},
        )
    return CompileConfig(dynamic=False, mode=None, options={"cpp_wrapper": True})


def record_eager_steps(drafter, seconds: float) -> None:
    """Add eager static draft-step time spent by `drafter` in this process (the rent of the ski rental)."""
    model_state(drafter).add_rent(seconds)


def compile_pays(drafter, compile_config: CompileConfig, lean: bool = False) -> bool:
    """A step compiled earlier in this process is reused; otherwise compile once the uncompiled steps spent so far
    (`lean`: lean steps) would have paid for the compilation."""
    if has_compiled_call(drafter, compile_config):
        return True
    saving = COMPILED_STEP_SAVING["lean" if lean else "eager"]
    return model_state(drafter).rent * saving >= COMPILE_SECONDS_ESTIMATE


def dynamo_graphs_so_far() -> int:
    """Dynamo graphs compiled in this process so far (a process-wide count: a step or a verification reads it before
    and after its call)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def cuda_graph_skips_so_far() -> int:
    """Compiled graphs inductor was asked to run as CUDA graphs and ran without (a mutated input, a CPU tensor, an
    op CUDA graphs cannot hold), process-wide: each is then launched kernel by kernel, host-bound on a GPU."""
    return torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]


@functools.cache
def compiling_again_failed() -> tuple[type[Exception], ...]:
    """What dynamo raises when a step whose guards failed cannot be compiled again (its recompile limit under
    `fullgraph=True`, a graph break, a backend failure): before the new graph runs."""
    names = ("TorchDynamoException", "FailOnRecompileLimitHit")
    return tuple(error for name in names if (error := getattr(torch._dynamo.exc, name, None)) is not None)
