"""The target forward per path: seconds of a decode step and of a verify of W drafts, v(W) in decode steps, GB/s.

    python benchmarks/engine/target_forward.py --threads 1 --widths 1,2,3,7 --repeats 15 [--clock cpu] --out FILE.json

Loads SmolLM2-135M three times (the HF path; the fast path's linear kernels, inference/engine/cpu/fastpath.py, under
HF's modules; and those kernels under the lean decode forward, inference/engine/cpu/lean.py, as the engine runs with
the fast path on), prefills the same 100-token context in each, then times `extend` over W + 1 tokens followed by
the rollback a full rejection does, the paths and widths taking turns inside every repeat (interleaved, medians). v(W) = t(W) / t(0) is what the engine's
cost profile measures per round minus the drafter; achieved GB/s = weight bytes per forward / t, beside the stream
probe (inference/engine/roofline.py). Also checks that the paths' logits agree with HF's (max abs difference).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo root

import torch

from benchmarks.measure import add_timing_arguments, timing_clock, write_measurement
from inference.engine.cpu import CpuBackend
from inference.engine.roofline import stream_bandwidth, weight_bytes
from inference.engine.target import TargetModel


def time_widths(targets: dict, widths: list[int], repeats: int, context: int, clock=time.perf_counter) -> dict:
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 10000, (1, context), generator=generator)
    blocks = {w: torch.randint(100, 10000, (1, w + 1), generator=generator) for w in widths}
    for target in targets.values():
        target.prefill(prompt, torch.ones_like(prompt))
    seconds = {(name, w): [] for name in targets for w in widths}
    with torch.no_grad():
        for attempt in range(repeats + 1):
            for w in widths:
                for name, target in targets.items():
                    mark = target.mark()
                    start = clock()
                    target.extend(blocks[w])
                    elapsed = clock() - start
                    target.keep_after(mark, torch.zeros(1, dtype=torch.long))
                    if attempt:
                        seconds[(name, w)].append(elapsed)
    return {key: statistics.median(values) for key, values in seconds.items()}


def max_logit_difference(targets: dict, context: int) -> float:
    """The largest |logit| difference of any path from the first one, over a prefill and a 4-token block."""
    prompt = torch.randint(100, 10000, (1, context), generator=torch.Generator().manual_seed(1))
    outputs = [torch.cat([target.prefill(prompt, torch.ones_like(prompt))[0], target.extend(prompt[:, :4])[0]], 1)
               for target in targets.values()]
    return max(float((out - outputs[0]).abs().max()) for out in outputs[1:])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_timing_arguments(parser)
    parser.add_argument("--widths", default="0,1,3,7")
    parser.add_argument("--context", type=int, default=100)
    args = parser.parse_args(argv)
    clock = timing_clock(args, parser)
    widths = [int(w) for w in args.widths.split(",")]
    if widths[0] != 0:
        widths = [0] + widths
    hf = TargetModel.from_pretrained("smollm2-135m-instruct")
    fast = TargetModel.from_pretrained("smollm2-135m-instruct", backend=CpuBackend(lean=False))
    lean = TargetModel.from_pretrained("smollm2-135m-instruct", backend=CpuBackend())
    targets = {"hf": hf, fast.path: fast, f"{lean.path}+{lean.decode}": lean}
    nbytes = weight_bytes(hf.model)
    stream = stream_bandwidth(clock=clock)
    difference = max_logit_difference(targets, args.context)
    medians = time_widths(targets, widths, args.repeats, args.context, clock)
    load = os.getloadavg()[0]
    result = {"threads": args.threads, "clock": args.clock, "load_1min": load, "weight_bytes": nbytes,
              "stream_gb_per_s": stream,
              "max_abs_logit_difference": difference, "paths": {}}
    for name in targets:
        step = medians[(name, 0)]
        result["paths"][name] = {
            "ar_step_ms": 1e3 * step, "achieved_gb_per_s": nbytes / step / 1e9,
            "verify_ms": {w: 1e3 * medians[(name, w)] for w in widths},
            "v": {w: medians[(name, w)] / step for w in widths},
            "achieved_gb_per_s_verify": {w: nbytes / medians[(name, w)] / 1e9 for w in widths}}
        row = result["paths"][name]
        print(f"{name:16s} threads={args.threads} {args.clock} AR {row['ar_step_ms']:6.1f} ms "
              f"{row['achieved_gb_per_s']:5.1f} GB/s"
              f" ({row['achieved_gb_per_s'] / stream:.0%} of stream)  "
              + "  ".join(f"v({w})={row['v'][w]:.2f}" for w in widths if w))
    ratio = "  ".join(f"hf/{name} {result['paths']['hf']['ar_step_ms'] / row['ar_step_ms']:.2f}x"
                      for name, row in result["paths"].items() if name != "hf")
    print(f"stream {stream:.1f} GB/s, weights {nbytes / 1e6:.0f} MB, AR step {ratio}, "
          f"max |logit diff| {difference:.2e}, load {load:.1f}")
    if args.out:
        write_measurement(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
