"""Seconds per training step (forward, backward, AdamW) of the same drafter in two source trees, interleaved: what the
long-sequence paths (drafters/chunked.py) cost or save against the tree before them.

    git worktree add /tmp/draftsmith-before 23e76d4
    OMP_NUM_THREADS=1 python benchmarks/training/long_sequence_speed.py --trees /tmp/draftsmith-before . \\
        [--variants eagle3_ttt3 dflash dspark] [--lengths 384 2048] [--batch 2] [--rounds 3] [--steps 3]

Each (tree, variant, length) runs `--steps` timed steps after one warm-up step in a fresh, single-threaded, nice'd
subprocess importing that tree; rounds alternate the trees so that machine load falls on both alike. The shapes are
benchmarks/training/long_sequence_memory.py's at SmolLM2-135M's width (hidden 576, 9 heads of 64, 3 KV heads, MLP 1536) and
the smollm2 recipes' drafters (EAGLE-3: 8,192 draft vocabulary; DFlash and DSpark: block 8, 32 anchors). Prints the
median seconds per step per tree and the ratio of the last tree to the first, with the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys, time, torch
torch.set_num_threads(1)
from drafters import DRAFTERS
from drafters.base import TargetInfo
from train.config import OptimConfig
from train.fit.optim import build_optimizer
spec = json.loads(sys.argv[1])
D, V, L, B = 576, 49152, spec["length"], spec["batch"]
g = torch.Generator().manual_seed(0)
config = {"hidden_size": D, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
          "intermediate_size": 1536, "num_hidden_layers": 30, "rope_theta": 100000.0, "vocab_size": V}
info = TargetInfo(name_or_path="synthetic", hidden_size=D, vocab_size=V, num_layers=30,
                  embed_weight=torch.randn(V, D, generator=g) * 0.02, lm_head_weight=torch.randn(V, D, generator=g) * 0.02,
                  final_norm_weight=torch.ones(D), rms_norm_eps=1e-5, eos_token_ids=(2,), pad_token_id=2, config=config,
                  unused_token_ids=(3,))
kind, fields = spec["kind"], spec["fields"]
torch.manual_seed(0)
drafter = DRAFTERS[kind](DRAFTERS[kind].Config(num_layers=1, **fields), info)
vocab = fields.get("draft_vocab_size") or V
batch = {"input_ids": torch.randint(4, vocab, (B, L), generator=g), "attention_mask": torch.ones(B, L, dtype=torch.long),
         "loss_mask": torch.ones(B, L, dtype=torch.long), "target_argmax": torch.randint(4, vocab, (B, L), generator=g),
         "hidden": {i: torch.randn(B, L, D, generator=g) for i in drafter.feature_request().layer_ids},
         "final_hidden": torch.randn(B, L, D, generator=g), "sample_index": torch.arange(B), "epoch": 0, "seed": 0}
optimizer = build_optimizer(drafter, OptimConfig(lr=1e-4))
times = []
for step in range(spec["steps"] + 1):
    started = time.perf_counter()
    loss, _ = drafter.loss(drafter(batch), batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    times.append(time.perf_counter() - started)
print(json.dumps({"seconds": times[1:]}))
"""

VARIANTS = {
    "eagle3_ttt3": ("eagle3", {"ttt_steps": 3, "draft_vocab_size": 8192, "layer_ids": [2, 15, 27]}),
    "eagle3_ttt7": ("eagle3", {"ttt_steps": 7, "draft_vocab_size": 8192, "layer_ids": [2, 15, 27]}),
    "dflash": ("dflash", {"block_size": 8, "num_anchors": 32, "mask_token_id": 3, "layer_ids": [2, 9, 15, 21, 28]}),
    "dspark": ("dspark", {"block_size": 8, "num_anchors": 32, "mask_token_id": 3, "markov_rank": 128,
                          "layer_ids": [2, 9, 15, 21, 28]}),
}


def run(tree: str, spec: dict) -> list[float]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=os.path.abspath(tree),
               HF_HUB_OFFLINE="1")
    out = subprocess.run(["nice", "-n", "10", sys.executable, "-c", CHILD, json.dumps(spec)], env=env, check=True,
                         capture_output=True, text=True, cwd=os.path.abspath(tree)).stdout
    return json.loads(out.strip().splitlines()[-1])["seconds"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", nargs="+", required=True, help="source trees to compare (the first is the base)")
    parser.add_argument("--variants", nargs="+", default=["eagle3_ttt3", "dflash", "dspark"], choices=list(VARIANTS))
    parser.add_argument("--lengths", type=int, nargs="+", default=[384, 2048])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=None, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    results = {}
    for variant in args.variants:
        kind, fields = VARIANTS[variant]
        for length in args.lengths:
            spec = {"kind": kind, "fields": fields, "length": length, "batch": args.batch, "steps": args.steps}
            samples: dict[str, list[float]] = {tree: [] for tree in args.trees}
            loads = []
            for _ in range(args.rounds):
                for tree in args.trees:
                    samples[tree] += run(tree, spec)
                    loads.append(os.getloadavg()[0])
            medians = {tree: statistics.median(values) for tree, values in samples.items()}
            ratio = medians[args.trees[-1]] / medians[args.trees[0]]
            results[f"{variant}@{length}x{args.batch}"] = {"median_seconds": medians, "ratio_last_to_first": ratio,
                                                           "load_1min": [min(loads), max(loads)], "threads": 1}
            print(variant, length, json.dumps(results[f"{variant}@{length}x{args.batch}"]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
