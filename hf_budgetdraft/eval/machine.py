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


def cpu_model() -> str:
    """The CPU's model name (`/proc/cpuinfo` on Linux, else what `platform` says; `"unknown"` if neither)."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def cpu_flags() -> list[str]:
    """The CPU's bfloat16 and matrix units among its `/proc/cpuinfo` flags (Linux; empty elsewhere)."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        return []
    for line in cpuinfo.read_text(errors="replace").splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return sorted(flags & {"avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx_vnni"})
    return []


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


def machine_text(description: dict | None = None) -> str:
    """One line for a table's header: `"AMD EPYC ... (AVX2), 2 logical CPUs"`."""
    described = description or machine()
    return f"{described['cpu']} ({described['cpu_capability']}), {described['logical_cpus']} logical CPUs"


def on_machine(meta: dict) -> str:
    """`", on <machine_text>"` for a table header when `meta` records its machine, else `""` (older results)."""
    return f", on {machine_text(meta['machine'])}" if meta.get("machine") else ""
