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


def add_timing_arguments(parser, repeats: int = 15) -> None:
    """The flags every timing benchmark shares: --threads, --repeats, --clock (wall | cpu), --out."""
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--clock", default="wall", choices=("wall", "cpu"),
                        help="cpu: this thread's CPU seconds (1 thread only), which a loaded machine's scheduling "
                             "does not inflate; wall: elapsed seconds")
    parser.add_argument("--out", default=None)


def timing_clock(args, parser):
    """Sets torch's threads to --threads and returns the clock --clock names (a parser error for cpu with threads)."""
    import time

    import torch

    if args.clock == "cpu" and args.threads != 1:
        parser.error("--clock cpu measures one thread: use it with --threads 1")
    torch.set_num_threads(args.threads)
    return time.thread_time if args.clock == "cpu" else time.perf_counter
