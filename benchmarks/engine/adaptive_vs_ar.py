"""Adaptive k against plain autoregression, interleaved call by call (a drafter whose drafts are
always rejected must not make decoding slower).

    OMP_NUM_THREADS=1 python benchmarks/engine/adaptive_vs_ar.py --drafter runs/bench/random_eagle3 \\
        --drafter runs/bench/E_cold/final --max-new-tokens 32 --repeats 7 --out docs/results/adaptive_vs_ar.json

One MT-Bench first turn (chat template), greedy, no EOS (every call emits exactly --max-new-tokens). Each repeat runs
AR, then every drafter with adaptive k, back to back, so the ratio of one repeat compares calls a few seconds apart;
on a shared machine whose load drifts over minutes this is far less noisy than comparing whole eval runs. Reported:
per drafter, the median over repeats of (its decode tokens/s) / (the AR call's decode tokens/s of the same repeat),
prefill excluded (both pay the same prefill; the drafter's `begin` is part of it), the widths it chose, and the
profiled cost curves it chose them from. One AdaptiveK per drafter serves all its calls, as in `draftsmith eval`
(what the first request learns carries over).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from drafters import load_drafter
from inference.engine.adaptive import AdaptiveK
from inference.engine.api import speculative_generate
from inference.engine.target import TargetModel
from inference.evaluation.environment import environment
from inference.evaluation.eval import render_prompt
from inference.evaluation.methods import AUTO_MAX_DRAFT_TOKENS
from inference.evaluation.profile import profile_costs
from inference.evaluation.prompts import load_questions


def decode_rate(out) -> float:
    """Tokens per second after the prefill (the first token comes from the prefill)."""
    return (sum(len(row) for row in out.tokens) - len(out.tokens)) / (out.time_total - out.time_prefill)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--drafter", action="append", required=True, help="a drafter directory (repeatable)")
    parser.add_argument("--question", type=int, default=0, help="index of the MT-Bench question")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = TargetModel.from_pretrained(args.target)
    _, questions = load_questions("mt_bench")
    prompt = render_prompt(target.tokenizer, questions[args.question].turns[:1], [], True)
    # served as eval serves it: on the target's device in its dtype (a drafter read from disk is on the CPU in fp32)
    drafters = {path: target.serve(load_drafter(path, target.target_info())) for path in args.drafter}
    limits = {path: d.max_draft_tokens() or AUTO_MAX_DRAFT_TOKENS for path, d in drafters.items()}
    costs = {path: profile_costs(target, d, [prompt], limits[path]) for path, d in drafters.items()}
    adaptive = {path: AdaptiveK(curves) for path, curves in costs.items()}  # one per drafter, as draftsmith eval
    rates = {path: [] for path in ["none"] + list(drafters)}
    chosen = {path: [0] * (limits[path] + 1) for path in drafters}
    speculative_generate(target, None, [prompt], num_draft_tokens=0, max_new_tokens=4)  # warm-up
    for _ in range(args.repeats):
        out = speculative_generate(target, None, [prompt], num_draft_tokens=0, max_new_tokens=args.max_new_tokens,
                                   eos_token_ids=[])
        rates["none"].append(decode_rate(out))
        for path, drafter in drafters.items():
            out = speculative_generate(target, drafter, [prompt], num_draft_tokens=limits[path],
                                       max_new_tokens=args.max_new_tokens, eos_token_ids=[],
                                       adaptive=adaptive[path])
            rates[path].append(decode_rate(out))
            for width in out.chosen[0]:
                chosen[path][width] += 1
    result = {"max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "env": environment(target.device),
              "ar_tokens_per_s": rates["none"], "drafters": {}}
    print("| drafter | median speedup vs AR (per repeat) | min | max | k chosen (rounds) |")
    print("|---|---|---|---|---|")
    for path in drafters:
        ratios = [r / a for r, a in zip(rates[path], rates["none"])]
        result["drafters"][path] = {"tokens_per_s": rates[path], "ratios": ratios,
                                    "median_ratio": statistics.median(ratios), "chosen_histogram": chosen[path],
                                    "cost_profile": costs[path].to_dict()}
        histogram = " ".join(f"{k}:{n}" for k, n in enumerate(chosen[path]) if n)
        print(f"| {path} | {statistics.median(ratios):.3f} | {min(ratios):.3f} | {max(ratios):.3f} | {histogram} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
