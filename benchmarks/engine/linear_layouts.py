"""Microbenchmark: one forward's worth of the target's linears at M = 1..8 rows, per weight layout and kernel.

    python benchmarks/engine/linear_layouts.py --threads 1 --rows 1,2,3,4,8 --repeats 15 --clock cpu --out FILE.json

Runs every decoder linear of SmolLM2-135M (30 layers: q, k, v, o, gate, up, down, as the model holds them) and the
lm_head once per measurement, in layer order as a forward does, so the 540 MB of weights stream from memory.
The variants take turns inside every repeat (interleaved: a drift of the machine's load hits each alike); the table
gives each one's median milliseconds and GB/s (weight bytes / time), and the ratio of every M to M = 1 (what a
verify of M tokens costs in decode steps, linears only), beside a stream probe of the same run.

Variants: `F.linear` (plain MKL sgemm on the [out, in] weight, today's path), `x@Wt` (the weight stored transposed,
[in, out] contiguous), `mkl-packed` (MKL's packed-weight GEMM, packed for this M), `onednn` (oneDNN's prepacked
linear, packed once with inference/engine/cpu/fastpath.py's hint), `onednn-pad4` (the same with fewer than 4 rows padded
to 4, as the fast path runs it), `fused-onednn` (q|k|v and gate|up concatenated: 4 GEMMs per layer instead of 7) and
`fast-path` (inference/engine/cpu/fastpath.FastLinear itself). `--clock cpu` times this thread's CPU seconds (1 thread
only): on a machine loaded by other work it leaves out the time the scheduler gives to others.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo root

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.measure import add_timing_arguments, timing_clock, write_measurement
from inference.engine.cpu import fastpath, kernels
from inference.engine.roofline import stream_bandwidth


def layer_weights(model) -> list[torch.Tensor]:
    """[out, in] weights of one forward in order: q, k, v, o, gate, up, down per layer, then the lm_head."""
    weights = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        weights += [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.o_proj.weight,
                    mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]
    return weights + [model.lm_head.weight]


def fused_weights(model) -> list[torch.Tensor]:
    """[out, in] weights of one forward in order: q|k|v, o, gate|up, down per layer, then the lm_head."""
    weights = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        weights += [torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]), attn.o_proj.weight,
                    torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), mlp.down_proj.weight]
    return weights + [model.lm_head.weight]


def variants(rows: int, prepared: dict) -> dict:
    """name -> a function of the inputs [rows, in] (one per weight of `layer_weights`) running every linear once."""
    weights = prepared["weights"]
    linear = torch.ops.mkldnn._linear_pointwise
    padded = max(rows, 4)

    def fused_inputs(xs):  # q, k, v and gate, up read the same input: one per fused weight
        return [x for i, x in enumerate(xs[:-1]) if i % 7 in (0, 3, 4, 6)] + [xs[-1]]

    out = {
        "F.linear": lambda xs: [F.linear(x, w) for x, w in zip(xs, weights)],
        "x@Wt": lambda xs: [x @ w for x, w in zip(xs, prepared["transposed"])],
        "onednn": lambda xs: [linear(x, w, None, "none", [], "") for x, w in zip(xs, prepared["packed"])],
        "onednn-pad4": lambda xs: [linear(x.new_zeros(padded, x.shape[1]).index_copy_(0, prepared["rows"][rows], x),
                                          w, None, "none", [], "") for x, w in zip(xs, prepared["packed"])],
        "fused-onednn": lambda xs: [linear(x, w, None, "none", [], "")
                                    for x, w in zip(fused_inputs(xs), prepared["fused_packed"])],
        "fast-path": lambda xs: [module(x) for x, module in zip(xs, prepared["modules"])],
    }
    if hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight"):
        mkl = [torch.ops.mkl._mkl_reorder_linear_weight(w, rows) for w in weights]
        out["mkl-packed"] = lambda xs: [torch.ops.mkl._mkl_linear(x, p, w, None, rows)
                                        for x, p, w in zip(xs, mkl, weights)]
    return out


def _fast(weights: list[torch.Tensor]) -> list[fastpath.FastLinear]:
    """The fast path's modules around `weights` (nn.Linears sharing them, each running the kernels
    inference/engine/cpu/kernels.py chooses for its shape on this machine, timings in the user's cache)."""
    linears = []
    for weight in weights:
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        linear.weight = nn.Parameter(weight, requires_grad=False)
        linears.append(linear)
    choices = kernels.choose(fastpath.by_shape(linears), kernels.CACHE_DIR)
    return [fastpath.FastLinear(linear, choices[fastpath.shape_of(linear)]["plan"]) for linear in linears]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_timing_arguments(parser)
    parser.add_argument("--rows", default="1,2,4,8")
    args = parser.parse_args(argv)
    clock = timing_clock(args, parser)
    from transformers import AutoModelForCausalLM

    from inference.assets.store import resolve_target

    model = AutoModelForCausalLM.from_pretrained(resolve_target("smollm2-135m-instruct"), dtype=torch.float32)
    weights = layer_weights(model)
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    fused = fused_weights(model)
    hint = kernels.PACK_HINT_ROWS
    prepared = {"weights": weights, "fused": fused, "transposed": [w.t().contiguous() for w in weights],
                "packed": [torch.ops.mkldnn._reorder_linear_weight(w, hint) for w in weights],
                "fused_packed": [torch.ops.mkldnn._reorder_linear_weight(w, hint) for w in fused],
                "modules": _fast(weights),
                "rows": {r: torch.arange(r) for r in range(1, 65)}}
    results = {"threads": args.threads, "clock": args.clock, "weight_bytes": nbytes,
               "stream_gb_per_s": stream_bandwidth(clock=clock), "rows": {}}
    with torch.no_grad():
        for rows in [int(r) for r in args.rows.split(",")]:
            runs = variants(rows, prepared)
            inputs = [torch.randn(rows, w.shape[1]) for w in weights]
            times = {name: [] for name in runs}
            for attempt in range(args.repeats + 1):
                for name, run in runs.items():
                    start = clock()
                    run(inputs)
                    if attempt:  # the first pass warms up (allocations, oneDNN primitive creation)
                        times[name].append(clock() - start)
            results["rows"][rows] = {name: {"ms": 1e3 * statistics.median(t),
                                            "gb_per_s": nbytes / statistics.median(t) / 1e9}
                                     for name, t in times.items()}
    base = results["rows"].get(1)
    for rows, row in results["rows"].items():
        for name, value in row.items():
            if base and name in base:
                value["vs_m1"] = value["ms"] / base[name]["ms"]
            ratio = f"  x{value['vs_m1']:.2f} of M=1" if "vs_m1" in value else ""
            print(f"M={rows} threads={args.threads} {name:11s} {value['ms']:7.1f} ms {value['gb_per_s']:5.1f} GB/s"
                  f"{ratio}")
    print(f"stream {results['stream_gb_per_s']:.1f} GB/s, weights {nbytes / 1e6:.0f} MB")
    if args.out:
        write_measurement(args.out, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
