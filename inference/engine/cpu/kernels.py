"""The small-M linear kernels of the CPU fast path, and the choice among them, made by timing on the machine itself.

Each CPU ranks the candidates differently at 1-16 rows (AMD EPYC with AVX2, Intel Xeon and AMD EPYC with AVX-512
each put another first), so nothing is chosen by hand: `choose` times every candidate for each row count on the
model's own weights (all linears of one shape in turn, and copies where a model has too few of a shape, so the
weights stream from memory as a forward streams them; the candidates interleaved inside every repeat, medians), and
keeps the fastest per row count among the kernels that read the weight itself and at most one other layout (one
extra copy of a weight at most). The timings are cached per CPU model, torch version, thread count, weight shape and
timing method in the directory the caller passes (users: CACHE_DIR), so only the first run on a machine pays for
it; a timing taken while other work held every core (`busy`) is used but not cached, and DRAFTSMITH_RETIME_KERNELS=1
times again whatever is cached. `plan_for` turns timings into the plan; it is a pure function (tests feed it fake timings).

Candidates (every one computes x W^T + b; they differ only in the order float32 products are summed):
- `linear`: F.linear on the [out, in] weight (MKL sgemm), the model's own kernel; no extra copy;
- `transposed`: the weight stored [in, out] contiguous, as a matrix product (one extra copy);
- `onednn`: oneDNN's prepacked linear (the weight reordered once into its blocked layout; one extra copy);
- `onednn-pad4`: the same with fewer than 4 rows padded to 4 (its 2-row kernel is slow on some CPUs);
- `mkl`: MKL's packed GEMM (cblas_sgemm_pack; one extra copy), where this torch has it.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from inference.engine.cpu.machine import cpu_flags, cpu_model

MAX_ROWS = 16  # rows timed and chosen per count; above, F.linear (MKL's large-M GEMM is near the compute roof)
PACK_HINT_ROWS = 8  # oneDNN's and MKL's reorder hint; oneDNN measured the same layout for hints 2..16
TIMED_ROWS = (1, 2, 3, 4, 5, 6, 8, 9, 12, 16)  # a count between two timed ones runs the next timed one's kernel
MIN_BYTES_PER_PASS = 64 << 20  # time a shape over enough weight bytes that they stream from memory, not cache
MAX_LINEARS_PER_PASS = 160  # ... but over at most this many linears (a tiny shape is cache-resident anyway)
TIMING = "streamed: >= 64 MiB or 160 linears per pass, copies where the model has fewer"  # in the cache key
CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "draftsmith", "kernels")  # the CPU backend's default
DEFAULT = "linear"


@dataclass(frozen=True)
class Kernel:
    """`layout` names the weight copy `run(x, copy, weight, bias)` reads ("weight": the parameter itself)."""

    layout: str
    run: Callable


def _padded_onednn(x, packed, weight, bias):
    rows = x.shape[0]
    if rows < 4:  # zero rows below the real ones; each output row depends on its input row only
        x = torch.cat([x, x.new_zeros(4 - rows, x.shape[1])])
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")[:rows]


def _transposed(x, weight_t, weight, bias):
    return x @ weight_t if bias is None else torch.addmm(bias, x, weight_t)


KERNELS = {
    "linear": Kernel("weight", lambda x, copy, weight, bias: F.linear(x, weight, bias)),
    "transposed": Kernel("transposed", _transposed),
    "onednn": Kernel("onednn", lambda x, packed, weight, bias: torch.ops.mkldnn._linear_pointwise(
        x, packed, bias, "none", [], "")),
    "onednn-pad4": Kernel("onednn", _padded_onednn),
}
if hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight"):
    KERNELS["mkl"] = Kernel("mkl", lambda x, packed, weight, bias: torch.ops.mkl._mkl_linear(
        x, packed, weight, bias, x.shape[0]))


def make_layout(layout: str, weight: torch.Tensor):
    """The copy of `weight` [out, in] a kernel reads."""
    with torch.no_grad():
        if layout == "weight":
            return None
        if layout == "transposed":
            return weight.detach().t().contiguous()
        if layout == "onednn":
            return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_HINT_ROWS)
        if layout == "mkl":
            return torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), PACK_HINT_ROWS)
    raise ValueError(f"unknown weight layout {layout!r}")


def plan_for(timings: dict[int, dict[str, float]]) -> list[str]:
    """The kernel for each row count 0..MAX_ROWS (index 0 unused) from median seconds per timed row count and
    kernel, reading the weight itself and at most one other layout: for each candidate layout (or none), the fastest
    allowed kernel at each timed count; the layout whose plan is the least slower than the fastest kernels, summed
    over the timed counts as ratios (each count weighs alike); none wins a tie. An untimed count runs the choice of
    the next timed count above it."""
    layouts = sorted({KERNELS[name].layout for by_kernel in timings.values() for name in by_kernel} - {"weight"})
    fastest = {rows: min(by_kernel.values()) for rows, by_kernel in timings.items()}
    best, best_cost = None, float("inf")
    for extra in [None] + layouts:
        allowed = {rows: sorted(name for name in by_kernel if KERNELS[name].layout in ("weight", extra))
                   for rows, by_kernel in timings.items()}
        if not all(allowed.values()):
            continue
        choice = {rows: min(names, key=lambda name: timings[rows][name]) for rows, names in allowed.items()}
        cost = sum(timings[rows][name] / max(fastest[rows], 1e-12) for rows, name in choice.items())
        if cost < best_cost:
            best, best_cost = choice, cost
    timed = sorted(best)
    return [DEFAULT] + [best[next((t for t in timed if t >= rows), timed[-1])] for rows in range(1, MAX_ROWS + 1)]


def machine_key(shape: tuple[int, int, bool]) -> str:
    """What a cached choice is valid for: the CPU model, torch, threads, the weight shape and the candidates."""
    return json.dumps({"cpu": cpu_model(), "cpu_flags": cpu_flags(), "torch": torch.__version__,
                       "threads": torch.get_num_threads(), "shape": list(shape), "kernels": sorted(KERNELS), "rows": list(TIMED_ROWS), "timing": TIMING})


def timing_set(linears: list) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """The (weight, bias) pairs one timed pass runs: the shape's own linears, and where they hold fewer than
    MIN_BYTES_PER_PASS, copies of them in fresh memory up to it (at most MAX_LINEARS_PER_PASS in all). So every
    shape is timed streaming from memory, as a forward over a whole model reads it, whatever number of linears of
    the shape this model has: a drafter's one 1536 x 576 pair, timed from cache and cached under the shape, would
    otherwise pick the kernels of the target's thirty, which stream (seen: a 0.5 ms cached pass chose the 1-row
    kernel a 5 ms streamed pass ranks third)."""
    nbytes = linears[0].weight.numel() * linears[0].weight.element_size()
    count = max(1, min(MAX_LINEARS_PER_PASS, -(-MIN_BYTES_PER_PASS // nbytes)))
    pairs = [(m.weight, m.bias) for m in linears[:count]]
    with torch.no_grad():
        for index in range(len(pairs), count):
            weight, bias = pairs[index % len(linears)]
            pairs.append((weight.detach().clone(), None if bias is None else bias.detach().clone()))
    return pairs


def time_shape(linears: list, repeats: int = 3, clock=time.perf_counter) -> dict[int, dict[str, float]]:
    """Median seconds of one pass over the `timing_set` of `linears` (modules of one shape: their weights and
    biases) per timed row count and kernel, the kernels interleaved inside every repeat; the first pass warms up."""
    pairs = timing_set(linears)
    layouts = {name: [make_layout(k.layout, weight) for weight, _ in pairs] for name, k in KERNELS.items()}
    result = {}
    with torch.no_grad():
        for rows in TIMED_ROWS:
            x = torch.randn(rows, pairs[0][0].shape[1])
            seconds = {name: [] for name in KERNELS}
            for attempt in range(repeats + 1):
                for name, kernel in KERNELS.items():
                    start = clock()
                    for (weight, bias), copy in zip(pairs, layouts[name]):
                        kernel.run(x, copy, weight, bias)
                    if attempt:
                        seconds[name].append(clock() - start)
            result[rows] = {name: statistics.median(s) for name, s in seconds.items()}
    return result


def busy() -> bool:
    """True when other work holds at least half the cores: the 1-minute load average, less this process's own
    threads, reaches cores / 2. A timing taken then ranks the kernels by who got scheduled, not by speed (seen on 2
    cores beside a training: a 2-row pass timed at 2-4x a 1-row one, 1.1x when quiet)."""
    return os.getloadavg()[0] - torch.get_num_threads() >= (os.cpu_count() or 1) / 2


def choose(linears_by_shape: dict[tuple[int, int, bool], list], cache_dir: str) -> dict:
    """{shape: {"plan": [kernel per row count], "timings_ms": {rows: {kernel: ms}}, "cached": bool}} for every shape,
    read from `cache_dir` where this machine timed it before (unless DRAFTSMITH_RETIME_KERNELS=1), else timed now and
    cached when the machine was not `busy` (the record keeps the load it was timed at)."""
    choices = {}
    retime = os.environ.get("DRAFTSMITH_RETIME_KERNELS", "") == "1"
    for shape, linears in linears_by_shape.items():
        key = machine_key(shape)
        path = os.path.join(cache_dir, hashlib.sha256(key.encode()).hexdigest()[:24] + ".json")
        cached = None if retime else _read(path, key)
        if cached is None:
            timings = time_shape(linears)
            cached = {"key": key, "timings": {str(r): {k: 1e3 * s for k, s in t.items()} for r, t in timings.items()},
                      "load_1min": os.getloadavg()[0]}
            if not busy():
                _write(path, cached)
        timings = {int(rows): by_kernel for rows, by_kernel in cached["timings"].items()}
        choices[shape] = {"plan": plan_for(timings), "timings_ms": timings, "cached": cached.get("read", False)}
    return choices


def _read(path: str, key: str) -> dict | None:
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return {**record, "read": True} if record.get("key") == key else None


def _write(path: str, record: dict) -> None:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump(record, f)
        os.replace(path + ".tmp", path)
    except OSError:  # a read-only home: the choice is timed again next time
        pass
