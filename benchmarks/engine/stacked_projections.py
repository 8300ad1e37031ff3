"""Separate against stacked q/k/v and gate/up projections in the lean fast-path forward (fastpath.stack), interleaved.

    python benchmarks/engine/stacked_projections.py --threads 2 [--repeats 20] [--widths 1,2,4,8]

Loads SmolLM2-135M twice with the fast path and the lean forward, once with LeanDecoder.stack turned off, prefills
the same 100-token context in both, then times `extend` over W tokens followed by a full rollback, the two targets
and the widths taking turns inside every repeat; prints median ms per forward (docs/benchmarks_archive.md,
"Stacked projections and kernels timed streaming").
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from inference.engine.cpu import CpuBackend
from inference.engine.cpu import lean as lean_module
from inference.engine.target import TargetModel


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--widths", default="1,2,4,8")
    args = parser.parse_args(argv)
    try:
        widths = [int(w) for w in args.widths.split(",")]
        if args.threads < 1 or args.repeats < 1 or min(widths) < 1:
            raise ValueError
    except ValueError:
        parser.error("--threads, --repeats and every --widths entry must be integers >= 1")
    torch.set_num_threads(args.threads)
    stack = lean_module.LeanDecoder.stack
    targets = {}
    for name in ("separate", "stacked"):
        lean_module.LeanDecoder.stack = stack if name == "stacked" else (lambda self, cache_dir: False)
        targets[name] = TargetModel.from_pretrained("smollm2-135m-instruct", backend=CpuBackend())
    lean_module.LeanDecoder.stack = stack
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 10000, (1, 100), generator=generator)
    blocks = {w: torch.randint(100, 10000, (1, w), generator=generator) for w in widths}
    for target in targets.values():
        target.prefill(prompt, torch.ones_like(prompt))
    seconds = {(name, w): [] for name in targets for w in widths}
    with torch.no_grad():
        for attempt in range(args.repeats + 1):  # attempt 0 warms up
            for w in widths:
                for name, target in targets.items():
                    mark = target.mark()
                    start = time.perf_counter()
                    target.extend(blocks[w])
                    elapsed = time.perf_counter() - start
                    target.keep_after(mark, torch.zeros(1, dtype=torch.long))
                    if attempt:
                        seconds[(name, w)].append(elapsed)
    print(f"threads {args.threads}, load {os.getloadavg()[0]:.2f}")
    for name in targets:
        print(f"  {name:9s} " + "  ".join(f"W={w}: {1e3 * statistics.median(seconds[(name, w)]):6.2f} ms"
                                          for w in widths))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
