"""How much of the target's held-out greedy text a frequency-chosen draft vocabulary covers.

A draft head over a reduced vocabulary (EAGLE-3's, or an MTP head given one) can never propose a token outside it, so
the share of the target's own greedy answer tokens that fall inside the top-N vocabulary caps the acceptance of every
draft position. The vocabulary is chosen as training chooses it (token counts on the loss-masked answer tokens of
the training conversations, `DraftVocab.from_counts`); coverage is read on the held-out conversations of the same
shipped file (its manifest names them; never trained on), whose answers are the target's greedy output.

    python benchmarks/training/vocab_coverage.py --sizes 8192,16384,32768 --out docs/results/vocab_coverage.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from drafters.vocab import DraftVocab  # noqa: E402
from inference.assets.store import resolve_target  # noqa: E402
from train.data.chat import tokenize_conversation  # noqa: E402
from train.data.shipped import heldout_ids  # noqa: E402

DATA = "recipes/smollm2/data/sharegpt_smollm2_10k.jsonl.gz"


def count_split(tokenizer, path: str, heldout: set[str], max_length: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Answer-token counts [V] of the training rows and of the held-out rows, and the number of rows read."""
    vocab_size = len(tokenizer)
    train = torch.zeros(vocab_size, dtype=torch.long)
    held = torch.zeros(vocab_size, dtype=torch.long)
    num_rows = 0
    with gzip.open(path, "rt") as stream:
        for line in stream:
            record = json.loads(line)
            encoded = tokenize_conversation(tokenizer, record["messages"], max_length)
            ids = torch.tensor(encoded["input_ids"])[torch.tensor(encoded["loss_mask"], dtype=torch.bool)]
            counts = held if record["id"] in heldout else train
            counts += torch.bincount(ids, minlength=vocab_size)
            num_rows += 1
    return train, held, num_rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--data", default=DATA)
    parser.add_argument("--sizes", default="8192,16384,32768")
    parser.add_argument("--max-length", type=int, default=512, help="as the long recipes' data.max_length")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_target(args.target))
    heldout = heldout_ids(args.data)
    if not heldout:
        raise SystemExit(f"--data: {args.data} has no manifest naming held-out conversations")
    train, held, num_rows = count_split(tokenizer, args.data, heldout, args.max_length)
    record = {"target": args.target, "data": args.data, "rows": num_rows, "heldout_rows": len(heldout),
              "train_answer_tokens": int(train.sum()), "heldout_answer_tokens": int(held.sum()),
              "distinct_train_ids": int((train > 0).sum()), "vocab_size": len(tokenizer),
              "python": platform.python_version(), "coverage": {}}
    for size in (int(s) for s in args.sizes.split(",")):
        ids = DraftVocab.from_counts(train, size).draft_ids
        record["coverage"][str(size)] = {"heldout": float(held[ids].sum()) / float(held.sum()),
                                         "train": float(train[ids].sum()) / float(train.sum())}
    print(json.dumps(record, indent=1))
    if args.out:
        with open(args.out, "w") as out:
            json.dump(record, out, indent=1)
            out.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
