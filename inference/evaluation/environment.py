"""What every measurement records about where it ran: software versions, device, dtype, threads and the CPU (no host
name). `draftsmith eval` writes it into each report's configuration; the benchmark scripts into their JSON
(benchmarks/measure.py)."""

from __future__ import annotations

import platform

import torch
import transformers

from inference.engine.cpu import cpu_flags, cpu_model


def environment(device: torch.device, dtype: torch.dtype = torch.float32) -> dict:
    """Software and hardware the numbers were measured on (no host name)."""
    env = {"torch": torch.__version__, "transformers": transformers.__version__,
           "python": platform.python_version(), "platform": f"{platform.system()} {platform.machine()}",
           "device": str(device), "dtype": str(dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
           "cpu": cpu_model(), "cpu_flags": cpu_flags()}
    backend = getattr(torch, device.type, None)  # torch.cuda also serves ROCm builds
    if device.type != "cpu" and hasattr(backend, "get_device_name"):
        env["accelerator"] = backend.get_device_name(device)
    return env
