"""`auto` against every fixed k for one drafter: measured (interleaved engine runs) and replayed (no timing).

    OMP_NUM_THREADS=1 python benchmarks/engine/auto_vs_fixed.py --drafter ngram --num-prompts 16 --max-new-tokens 128 \\
        --ks 1,2,3,4 --repeats 3 --out docs/results/auto_vs_fixed_ngram.json

The drafter's cost profile is measured once (inference/evaluation/profile.profile_costs, batch 1, the first prompt) and
one AdaptiveK serves every request, as in `draftsmith eval`. MT-Bench first turns (chat template), greedy, the
target's EOS. Each repeat runs every prompt with AR, every fixed k and auto back to back, so a drift of the machine's
load hits them alike; reported per method: the median over repeats of (AR decode seconds) / (its decode seconds)
over all prompts (prefill excluded), tau, and auto's chosen widths.
Replayed: the same greedy continuations replayed through each policy with the profile's costs in place of the clock
(benchmarks/engine/replay.py; exact for the n-gram drafter), a deterministic speedup beside the measured one.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo root

import torch

from benchmarks.engine.replay import Replay, replay
from drafters import load_drafter
from inference.engine.adaptive import AdaptiveK
from inference.engine.api import speculative_generate
from inference.engine.policy import FixedWidth
from inference.engine.target import TargetModel
from inference.evaluation.environment import environment
from inference.evaluation.methods import AUTO_MAX_DRAFT_TOKENS
from inference.evaluation.profile import profile_costs
from inference.evaluation.prompts import load_questions


def chat_prompts(target, num_prompts: int) -> list[list[int]]:
    _, questions = load_questions("mt_bench", num_prompts=num_prompts)
    prompts = []
    for question in questions:
        messages = [{"role": "user", "content": question.turns[0]}]
        text = target.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompts.append(target.tokenizer(text, add_special_tokens=False)["input_ids"])
    return prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--drafter", default="ngram", help="ngram or a drafter directory")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--ks", default="1,2,3,4", help="the fixed widths to compare with")
    parser.add_argument("--repeats", type=int, default=3, help="measured passes (0: replay only)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None)
    parser.add_argument("--save-traces", default=None, help="write the prompts, continuations and profile (in AR "
                        "steps) as tests/data/ngram_traces_smollm2.json holds them")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = TargetModel.from_pretrained(args.target)
    drafter = target.serve(load_drafter(args.drafter, target.target_info()))  # on the target's device, in its dtype
    limit = drafter.max_draft_tokens()
    auto_width = limit if limit is not None else AUTO_MAX_DRAFT_TOKENS
    ks = [int(k) for k in args.ks.split(",")]
    prompts = chat_prompts(target, args.num_prompts)
    costs = profile_costs(target, drafter, prompts[:1], max(ks + [auto_width]))
    auto = AdaptiveK(costs, max_width=auto_width)
    methods = {"ar": None, **{f"k={k}": k for k in ks}, "auto": auto_width}
    seconds = {name: [] for name in methods}
    rounds = {name: [0, 0] for name in methods}  # rounds, accepted
    chosen: collections.Counter = collections.Counter()
    continuations = {}
    for attempt in range(args.repeats):
        total = dict.fromkeys(methods, 0.0)
        for index, prompt in enumerate(prompts):
            for name, width in methods.items():
                out = speculative_generate(target, None if width is None else drafter, [prompt],
                                           num_draft_tokens=width or 0, max_new_tokens=args.max_new_tokens,
                                           adaptive=auto if name == "auto" else None)
                total[name] += out.time_total - out.time_prefill
                rounds[name][0] += len(out.accept_lengths[0])
                rounds[name][1] += sum(out.accept_lengths[0])
                continuations[index] = out.tokens[0]
                if name == "auto":
                    chosen.update(out.chosen[0])
        for name in methods:
            seconds[name].append(total["ar"] / total[name])
    if not continuations:  # replay only: the continuations of plain greedy decoding
        for index, prompt in enumerate(prompts):
            out = speculative_generate(target, None, [prompt], num_draft_tokens=0, max_new_tokens=args.max_new_tokens)
            continuations[index] = out.tokens[0]
    if args.save_traces:
        steps = costs.in_ar_steps()
        with open(args.save_traces, "w") as f:
            json.dump({"d": steps["d"], "v": steps["v"], "traces": [
                {"prompt": prompt, "continuation": continuations[index]} for index, prompt in enumerate(prompts)]}, f)
    replayed = {}
    policies = {**{f"k={k}": FixedWidth(k) for k in ks}, "auto": AdaptiveK(costs, max_width=auto_width)}
    for name, policy in policies.items():
        result = Replay()
        for index, prompt in enumerate(prompts):
            replay(policy, target.serve(load_drafter(args.drafter, target.target_info())), prompt,
                   continuations[index], costs, result)
        replayed[name] = {"speedup": result.speedup, "tau": 1 + sum(result.accepted) / len(result.accepted),
                          "chosen": dict(sorted(collections.Counter(result.chosen).items()))}
    rows = []
    for name in policies:
        measured = statistics.median(seconds[name]) if seconds[name] else None
        tau = 1 + rounds[name][1] / rounds[name][0] if rounds[name][0] else None
        rows.append({"method": name, "measured_speedup": measured, "measured_tau": tau, **{
            f"replayed_{key}": value for key, value in replayed[name].items()}})
        shown = "-" if measured is None else f"{measured:.3f}"
        print(f"{name}: measured {shown}, replayed {replayed[name]['speedup']:.3f} (tau "
              f"{replayed[name]['tau']:.2f}) {replayed[name]['chosen'] if name == 'auto' else ''}")
    best = max((row for row in rows if row["method"] != "auto"), key=lambda row: row["replayed_speedup"])
    result = {"drafter": args.drafter, "costs_in_ar_steps": costs.in_ar_steps(), "rows": rows,
              "auto_measured_chosen": dict(sorted(chosen.items())), "best_fixed_replayed": best["method"],
              "env": environment(target.device), "threads": args.threads}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
