"""The CPU a number was measured on: its model name and the vector-ISA flags that decide which kernels win there."""

from __future__ import annotations

import os
import platform

ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "asimd", "sve")


def _cpuinfo_field(name: str) -> str | None:
    if not os.path.isfile("/proc/cpuinfo"):
        return None
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.split(":")[0].strip() == name), None)


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what the platform reports."""
    return _cpuinfo_field("model name") or platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    """The ISA_FLAGS this CPU has (x86 `flags`, Arm `Features`), in ISA_FLAGS order."""
    present = set((_cpuinfo_field("flags") or _cpuinfo_field("Features") or "").split())
    return [flag for flag in ISA_FLAGS if flag in present]
