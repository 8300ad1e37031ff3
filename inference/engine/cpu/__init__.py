"""The CPU backend (inference/engine/backend.py is the seam): code outside this folder imports it from here only."""

from inference.engine.cpu.backend import CpuBackend, CpuPrepared
from inference.engine.cpu.fastpath import FAST_PATH, KernelRecord
from inference.engine.cpu.machine import cpu_flags, cpu_model

__all__ = ["FAST_PATH", "CpuBackend", "CpuPrepared", "KernelRecord", "cpu_flags", "cpu_model"]
