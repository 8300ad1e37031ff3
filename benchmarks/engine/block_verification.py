"""Block against token-wise verification at temperature > 0 (inference/engine/verify.py): the drafts a round keeps.

    python -m benchmarks.engine.block_verification --target smollm2-135m-instruct --drafter DIR --prompts mt_bench \
        --num-prompts 8 --max-new-tokens 96 --k 3 --temperature 1 --seeds 3 --out FILE.json

For each seed and each way the drafter draws its drafts (sampled from its q, the drafter's sample_drafts, which is
what block verification gains on; argmax, where both verifications keep the same drafts in expectation), the same
first turns are decoded, all prompts in one batch, verified token by token and as a block, one after the other.
tau = 1 + accepted / rounds and the acceptance per position are pooled over seeds; each seed's tau is kept beside
them. Verification computes the same target forward either way, so a round costs the same and tau decides the speedup.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.measure import write_measurement
from drafters import load_drafter
from inference.engine.api import speculative_generate
from inference.engine.target import TargetModel
from inference.engine.verify import VERIFICATIONS
from inference.evaluation.eval import render_prompt
from inference.evaluation.metrics import acceptance_counts
from inference.evaluation.prompts import load_questions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--drafter", required=True, help="a drafter checkpoint whose kind can sample its drafts")
    parser.add_argument("--prompts", default="mt_bench")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.temperature <= 0:
        parser.error("--temperature: verification only differs when sampling (> 0)")
    torch.set_num_threads(args.threads)
    target = TargetModel.from_pretrained(args.target, dtype=torch.float32)
    drafter = target.serve(load_drafter(args.drafter, target.target_info()))
    if not hasattr(drafter.config, "sample_drafts"):
        parser.error(f"--drafter {args.drafter}: a {drafter.kind} drafter does not sample its drafts")
    _, questions = load_questions(args.prompts, num_prompts=args.num_prompts)
    prompts = [render_prompt(target.tokenizer, q.turns[:1], [], True) for q in questions]
    rows = []
    for sampled in (True, False):
        drafter.config.sample_drafts = sampled
        for verification in VERIFICATIONS:
            pooled = {"rounds": 0, "accepted": 0, "survived": [0] * args.k}
            per_seed = []
            for seed in range(args.seeds):
                out = speculative_generate(target, drafter, prompts, num_draft_tokens=args.k,
                                           max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                           seed=seed, eos_token_ids=list(target.target_info().eos_token_ids),
                                           verification=verification)
                counts = acceptance_counts(out)
                per_seed.append(round(1 + counts["accepted"] / counts["rounds"], 4))
                pooled["rounds"] += counts["rounds"]
                pooled["accepted"] += counts["accepted"]
                pooled["survived"] = [a + b for a, b in zip(pooled["survived"], counts["survived"])]
            row = {"drafts": "sampled" if sampled else "argmax", "verification": verification,
                   "tau": round(1 + pooled["accepted"] / pooled["rounds"], 4), "tau_per_seed": per_seed,
                   "acceptance_per_position": [round(s / pooled["rounds"], 4) for s in pooled["survived"]],
                   "rounds": pooled["rounds"]}
            rows.append(row)
            print(row, flush=True)
    write_measurement(args.out, {"target": args.target, "drafter": args.drafter, "prompts": args.prompts,
                                 "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "k": args.k,
                                 "temperature": args.temperature, "seeds": args.seeds, "threads": args.threads,
                                 "rows": rows})


if __name__ == "__main__":
    main()
