"""The memory roofline of a batch-1 decoder forward: the weight bytes it must read and the rate the machine reads at.

A decode step at small batch reads every weight once and does two flops per weight per row, far below what the cores
compute, so its floor is weight_bytes / stream bandwidth. `achieved_gb_per_s` (weight bytes / measured seconds per
forward) beside `stream_gb_per_s` (a read-only pass over a buffer far larger than the caches, measured at start-up)
says how far a forward is from that floor.
"""

from __future__ import annotations

import time

import torch

PROBE_BYTES = 256 << 20  # far beyond any last-level cache, small enough to allocate anywhere


def weight_bytes(model) -> int:
    """Bytes of the parameters one forward reads in full: every parameter once (tied ones once), except an input
    embedding that is not also the output head (a forward reads only the rows of its tokens)."""
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight.data_ptr() == embed.data_ptr()
    seen, total = set(), 0
    for parameter in model.parameters():
        if parameter.data_ptr() in seen or (parameter is embed and not tied):
            continue
        seen.add(parameter.data_ptr())
        total += parameter.numel() * parameter.element_size()
    return total


def stream_bandwidth(nbytes: int = PROBE_BYTES, repeats: int = 5, device="cpu", clock=time.perf_counter) -> float:
    """GB/s of a read-only reduction over an `nbytes` buffer, the median of `repeats` passes after one warm-up: the
    access pattern of reading weights, at the current torch thread count. `clock`: wall seconds by default;
    time.thread_time to compare with forwards timed in one thread's CPU seconds."""
    buffer = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    seconds = []
    for attempt in range(repeats + 1):
        start = clock()
        buffer.sum().item()
        if attempt:
            seconds.append(clock() - start)
    seconds.sort()
    return nbytes / seconds[len(seconds) // 2] / 1e9


def achieved_gb_per_s(nbytes: int | None, seconds_per_forward: float | None) -> float | None:
    """Weight bytes read per forward / seconds per forward, in GB/s (None when either is unknown)."""
    if not nbytes or not seconds_per_forward or seconds_per_forward <= 0:
        return None
    return nbytes / seconds_per_forward / 1e9
