"""Held-out acceptance of trained drafters: the one evaluator of the trainer-parity work (docs/benchmarks.md, "Trainer
parity"), on any drafter directory or training checkpoint.

    python benchmarks/training/heldout_tau.py --drafter runs/modelopt_synthetic/checkpoints/step_500 \
        --drafter runs/modelopt_synthetic/final --k 7 --out docs/results/modelopt_synthetic_heldout.json

Each drafter decodes the first turn of `--num-prompts` questions of `--prompts` (greedy, `--max-new-tokens` new
tokens, k drafts a round) with our engine against the target; heldout_tau = 1 + accepted / rounds over all prompts,
with the accepted drafts per position, heldout_tau_ci95 (the bootstrap interval over the questions,
inference/evaluation/intervals.tau_interval) and heldout_per_question ([rounds, accepted] per question, in prompt
order: two drafters' files compare question by question, intervals.tau_difference_interval). A training checkpoint (<output.dir>/checkpoints/step_N) is read through its
recipe and weights (train/fit/checkpoint.py), any other directory through our readers (drafters.load_drafter).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def first_turns(target, prompts: str, num_prompts: int | None) -> list[str]:
    """The first turn of each question, rendered with the target's chat template."""
    from inference.evaluation.eval import render_prompt
    from inference.evaluation.prompts import load_questions

    _, questions = load_questions(prompts, num_prompts=num_prompts)
    return [render_prompt(target.tokenizer, q.turns[:1], [], True) for q in questions]


def decode(target, drafter, prompts: list[str], k: int, max_new_tokens: int) -> dict:
    """Greedy speculative decoding of `prompts`: tau, rounds and accepted drafts per position."""
    from inference.engine.api import speculative_generate
    from inference.evaluation.intervals import question_counts, tau_interval
    from inference.evaluation.metrics import acceptance_counts

    out = speculative_generate(target, drafter, prompts, num_draft_tokens=k, max_new_tokens=max_new_tokens)
    counts = acceptance_counts(out)
    per_question = question_counts(out, list(range(len(prompts))))
    interval = tau_interval(list(per_question.values()))
    return {"heldout_tau": round(1 + counts["accepted"] / counts["rounds"], 4), "heldout_k": k,
            "heldout_tau_ci95": None if interval is None else [round(x, 4) for x in interval],
            "heldout_rounds": counts["rounds"], "heldout_accepted_per_position": counts["survived"],
            "heldout_per_question": [per_question[i] for i in range(len(prompts))]}


def main(argv: list[str] | None = None) -> int:
    from inference.engine.target import TargetModel
    from train.fit.checkpoint import load_trained_drafter

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", action="append", required=True, help="a drafter directory or training checkpoint")
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", default="mt_bench")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=None, help="drafts a round (default: the drafter's longest proposal)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="JSON file: one row per drafter")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        target = TargetModel.from_pretrained(args.target)
        prompts = first_turns(target, args.prompts, args.num_prompts)
        rows = []
        for directory in args.drafter:
            drafter = load_trained_drafter(directory, target.target_info())
            if drafter is None:
                raise ValueError(f"--drafter {directory}: not a trained drafter")
            drafter = target.serve(drafter)  # eval mode, on the target's device in its dtype, as eval serves it
            k = args.k or drafter.max_draft_tokens()
            if not k:
                raise ValueError(f"--drafter {directory}: the drafter has no longest proposal; pass --k")
            row = {"drafter": directory, **decode(target, drafter, prompts, k, args.max_new_tokens),
                   "heldout_prompts": f"{args.prompts} x {len(prompts)} first turns, {args.max_new_tokens} new tokens"}
            print(json.dumps(row))
            rows.append(row)
    except ValueError as err:
        print(f"heldout_tau: error: {err}", file=sys.stderr)
        return 2
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
