"""Microbenchmark: one forward's worth of the target's linears at M = 1..8 rows, per weight layout and kernel.

    python benchmarks/linear_layouts.py --threads 1 --rows 1,2,4,8 --repeats 15 --out runs/perf/linear_t1.json

Runs every decoder linear of SmolLM2-135M (30 layers; q|k|v and gate|up fused, as inference/engine/fastpath.py
computes them) and the lm_head once per measurement, in layer order as a forward does, so the 540 MB of weights
stream from memory. The variants take turns inside every repeat (interleaved: a drift of the machine's load hits
each alike); the table gives each one's median milliseconds and GB/s (weight bytes / time), and the ratio of every
M to M = 1 (what a verify of M tokens costs in decode steps, linears only), beside a stream probe of the same run.

Variants: `F.linear` (plain MKL sgemm on the [out, in] weight, today's path), `x@Wt` (the weight stored transposed,
[in, out] contiguous), `mkl-packed` (MKL's packed-weight GEMM, packed for this M), `onednn` (oneDNN's prepacked
linear, packed for this M) and `onednn(1)` (packed once for M = 1 and used at every M, what a fast path can keep).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from inference.engine.roofline import stream_bandwidth


def fused_weights(model) -> list[torch.Tensor]:
    """[out, in] weights of one forward in order: q|k|v, o, gate|up, down per layer, then the lm_head."""
    weights = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        weights += [torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]), attn.o_proj.weight,
                    torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), mlp.down_proj.weight]
    return weights + [model.lm_head.weight]


def variants(weights: list[torch.Tensor], rows: int, packed_one: list) -> dict:
    """name -> a function of the inputs [rows, in] (one per weight) that runs every linear once."""
    transposed = [w.t().contiguous() for w in weights]
    out = {
        "F.linear": lambda xs: [F.linear(x, w) for x, w in zip(xs, weights)],
        "x@Wt": lambda xs: [x @ w for x, w in zip(xs, transposed)],
        "onednn(1)": lambda xs: [torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
                                 for x, w in zip(xs, packed_one)],
    }
    if hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight"):
        mkl = [torch.ops.mkl._mkl_reorder_linear_weight(w, rows) for w in weights]
        out["mkl-packed"] = lambda xs: [torch.ops.mkl._mkl_linear(x, p, w, None, rows)
                                        for x, p, w in zip(xs, mkl, weights)]
    dnn = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in weights]
    out["onednn"] = lambda xs: [torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
                                for x, w in zip(xs, dnn)]
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from inference.assets.store import resolve_target

    model = AutoModelForCausalLM.from_pretrained(resolve_target("smollm2-135m-instruct"), dtype=torch.float32)
    weights = fused_weights(model)
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    packed_one = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in weights]
    results = {"threads": args.threads, "weight_bytes": nbytes, "stream_gb_per_s": stream_bandwidth(), "rows": {}}
    with torch.no_grad():
        for rows in [int(r) for r in args.rows.split(",")]:
            runs = variants(weights, rows, packed_one)
            inputs = [torch.randn(rows, w.shape[1]) for w in weights]
            times = {name: [] for name in runs}
            for attempt in range(args.repeats + 1):
                for name, run in runs.items():
                    start = time.perf_counter()
                    run(inputs)
                    if attempt:  # the first pass warms up (allocations, oneDNN primitive creation)
                        times[name].append(time.perf_counter() - start)
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
        with open(args.out, "w") as handle:
            json.dump(results, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
