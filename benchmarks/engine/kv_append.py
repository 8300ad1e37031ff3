"""A decode step's cost with the cache layers transformers gives (DynamicLayer: every append concatenates the whole
layer) against drafters/ragged_state.RoomyLayer (appends written into room kept after the prefill), interleaved in
one process on SmolLM2 with the fast path: CPU seconds of this thread (a loaded machine's scheduling does not inflate
them), the median of `--steps` decode steps after `--context` prompt tokens, the median over `--repeats` alternations.

    python benchmarks/engine/kv_append.py --context 100,400,1500 [--threads 1] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo root

import torch
from transformers.cache_utils import DynamicLayer

import drafters.ragged_state as ragged_state
from benchmarks.measure import write_measurement
from inference.engine.cpu import CpuBackend
from inference.engine.target import TargetModel

ROOMY = ragged_state.FamilyState.new_cache


def dynamic_cache(family):
    """The engine's cache with transformers' DynamicLayer where it would put a RoomyLayer."""
    cache = ROOMY(family)
    for index, layer in enumerate(cache.layers):
        if isinstance(layer, ragged_state.RoomyLayer):
            cache.layers[index] = DynamicLayer()
    return cache


def step_ms(target: TargetModel, context: int, roomy: bool, steps: int) -> float:
    ragged_state.FamilyState.new_cache = ROOMY if roomy else dynamic_cache
    try:
        ids = torch.randint(0, 49000, (1, context), generator=torch.Generator().manual_seed(context))
        target.prefill(ids, torch.ones_like(ids))
        token = torch.tensor([[5]])
        for _ in range(3):
            target.extend(token)
        seconds = []
        for _ in range(steps):
            start = time.thread_time()
            target.extend(token)
            seconds.append(time.thread_time() - start)
    finally:
        ragged_state.FamilyState.new_cache = ROOMY
    return statistics.median(seconds) * 1000


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", default="100,400,1500")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    target = TargetModel.from_pretrained("smollm2-135m-instruct", backend=CpuBackend())
    rows = []
    for context in (int(c) for c in args.context.split(",")):
        dynamic, roomy = [], []
        for _ in range(args.repeats):
            dynamic.append(step_ms(target, context, False, args.steps))
            roomy.append(step_ms(target, context, True, args.steps))
        row = {"context": context, "dynamic_ms": statistics.median(dynamic), "roomy_ms": statistics.median(roomy)}
        row["ratio"] = row["roomy_ms"] / row["dynamic_ms"]
        rows.append(row)
        print(f"context {context}: DynamicLayer {row['dynamic_ms']:.2f} ms, RoomyLayer {row['roomy_ms']:.2f} ms, "
              f"ratio {row['ratio']:.3f}")
    if args.out:
        write_measurement(args.out, {"rows": rows, "threads": args.threads, "steps": args.steps,
                                     "repeats": args.repeats, "clock": "thread cpu"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
