"""Where a decode step's time goes on the fast path: torch.profiler over SmolLM2-135M's forward of W + 1 tokens after
a 100-token context (W = 0: a plain decoding step), the rollback a full rejection does after each, the ops ranked by
their own CPU time, and the share in the linears (aten::mm / addmm, oneDNN's and MKL's packed linears) beside the
rest (attention, norms, rotary, the ops between).

    HF_HUB_OFFLINE=1 python benchmarks/engine/decode_profile.py --threads 1 [--width 0] [--steps 10] [--rows 18]

The profiler adds a few microseconds to every op, so the step reads slower than benchmarks/engine/target_forward.py
measures it; the split between the linears and the rest is what this is for.
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from inference.engine.cpu import CpuBackend
from inference.engine.target import TargetModel

LINEAR_OPS = ("aten::mm", "aten::addmm", "mkldnn::_linear_pointwise", "mkl::_mkl_linear")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--width", type=int, default=0, help="drafts verified per forward (0: a decode step)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rows", type=int, default=18, help="ops listed")
    args = parser.parse_args(argv)
    if args.threads < 1 or args.width < 0 or args.steps < 1:
        parser.error("--threads and --steps take a count >= 1, --width one >= 0")
    torch.set_num_threads(args.threads)
    target = TargetModel.from_pretrained("smollm2-135m-instruct", backend=CpuBackend())
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 10000, (1, 100), generator=generator)
    block = torch.randint(100, 10000, (1, args.width + 1), generator=generator)
    target.prefill(prompt, torch.ones_like(prompt))

    def step():
        mark = target.mark()
        target.extend(block)
        target.keep_after(mark, torch.zeros(1, dtype=torch.long))

    for _ in range(5):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            step()
    events = prof.key_averages()
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    total = sum(e.self_cpu_time_total for e in events) / 1e3 / args.steps
    linears = sum(e.self_cpu_time_total for e in events if e.key in LINEAR_OPS) / 1e3 / args.steps
    print(f"path {target.path}+{target.decode}, threads {args.threads}, width {args.width}: {total:.1f} ms a step "
          f"under the profiler, {linears:.1f} ms in the linears ({linears / total:.0%}), {total - linears:.1f} ms "
          f"outside them")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
