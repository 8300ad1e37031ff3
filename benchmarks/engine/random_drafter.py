"""Write a random-weights copy of a drafter checkpoint: the broken drafter adaptive k is checked with (its drafts are
almost always rejected, so adaptive k must fall back to plain autoregression).

    python benchmarks/engine/random_drafter.py runs/bench/E_cold/final runs/bench/random_eagle3 --target smollm2-135m-instruct

Same kind, same config, fresh initialisation (seeded), native format.
"""

from __future__ import annotations

import argparse

import torch

from drafters import load_drafter
from inference.engine.target import TargetModel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="a drafter checkpoint directory whose kind and config are copied")
    parser.add_argument("out", help="directory for the random-weights checkpoint")
    parser.add_argument("--target", required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    info = TargetModel.from_pretrained(args.target).target_info()
    trained = load_drafter(args.source, info)
    torch.manual_seed(args.seed)
    random = type(trained)(trained.checkpoint_config(), info)
    random.save(args.out)
    print(f"wrote a random-weights {random.kind} drafter to {args.out}")


if __name__ == "__main__":
    main()
