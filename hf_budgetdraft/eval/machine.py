"""Which machine a measurement ran on: the CPU's model and vector units, as every benchmark's metadata records them.

Absolute speeds on CPU depend on the vector units more than on the clock: a bfloat16 linear layer runs several
times faster than float32 on a CPU with AMX or AVX512-BF16 and several times slower on one with AVX2 only, and
float32 itself runs about twice as fast with AVX512. A table read without its machine cannot be compared with
another."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch


def _cpuinfo_field(name: str) -> str | None:
    """The value of `/proc/cpuinfo`'s first `name` line (Linux), or `None` where there is none."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        return None
    for line in cpuinfo.read_text(errors="replace").splitlines():
        if line.startswith(name):
            return line.split(":", 1)[1].strip()
    return None


def cpu_model() -> str:
    """The CPU's model name (`/proc/cpuinfo` on Linux, else what `platform` says; `"unknown"` if neither)."""
    return _cpuinfo_field("model name") or platform.processor() or "unknown"


def cpu_flags() -> list[str]:
    """The CPU's bfloat16 and matrix units among its `/proc/cpuinfo` flags (Linux; empty elsewhere)."""
    flags = set((_cpuinfo_field("flags") or "").split())
    return sorted(flags & {"avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx_vnni"})


def machine() -> dict:
    """`{system, arch, cpu, cpu_capability, cpu_flags, logical_cpus}`: `cpu_capability` is the vector instruction
    set torch's CPU kernels dispatch to (`"AVX2"`, `"AVX512"`, ...)."""
    return {
        "system": platform.system(),
        "arch": platform.machine(),
        "cpu": cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_flags": cpu_flags(),
        "logical_cpus": os.cpu_count(),
    }


def machine_text(described: dict) -> str:
    """One line for a table's header from a `machine()` dict: `"AMD EPYC ... (AVX2), 2 logical CPUs"`."""
    return f"{described['cpu']} ({described['cpu_capability']}), {described['logical_cpus']} logical CPUs"


def on_machine(meta: dict) -> str:
    """`", on <machine_text>"` for a table header when `meta` records its machine, else `""` (older results)."""
    return f", on {machine_text(meta['machine'])}" if meta.get("machine") else ""
