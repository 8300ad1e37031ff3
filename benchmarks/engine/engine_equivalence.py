"""Dump what the engine emits for a fixed set of calls, so a refactor of the loop can be proved output-identical.

    OMP_NUM_THREADS=1 python benchmarks/engine/engine_equivalence.py --out /tmp/before.json
    (change the engine)
    OMP_NUM_THREADS=1 python benchmarks/engine/engine_equivalence.py --out /tmp/after.json --compare /tmp/before.json

Every registered drafter kind (the contract test's tiny factories, random weights, float64 debug target) runs chain
k = 0, 1, 3, `auto` (AdaptiveK over fixed synthetic costs, so no timing enters a decision), a static-threshold and
a prefix-scheduler schedule (costs scaled so that the measured draft seconds cannot change a decision) and a tree
of budget 4, at batch 1 and 3, greedy and T = 1. With --smollm2, the n-gram drafter on smollm2-135m-instruct (a few
held-out prompts, fp32) at k = 1, 3 and auto, batch 1 and 3. Per call: tokens, accept_lengths, proposed, chosen.
Exit 1 when --compare finds a difference (each one is printed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from test_contract import KINDS, SAMPLING, build, tiny_target  # noqa: E402

from inference.engine.adaptive import AdaptiveK  # noqa: E402
from inference.engine.schedule import PrefixScheduler, StaticThreshold  # noqa: E402

try:
    from inference.engine.api import speculative_generate, tree_speculative_generate
except ImportError:  # the engine before its facades left the loop module
    from inference.engine.generate import speculative_generate, tree_speculative_generate

PROMPTS = {1: [[5, 6, 7, 8, 9, 10]], 3: [[5, 6, 7, 8, 9, 10], [20, 21], [30, 3, 17, 5]]}  # ids < 32: the T = 1 vocab


def costs(max_width: int, draft_step: float, verify_slope: float, num_rows: int = 1, scale: float = 1.0):
    """Synthetic cost curves d(W) = W draft_step, v(W) = 1 + W verify_slope, in whichever class the engine has."""
    draft = tuple(scale * draft_step * w for w in range(max_width + 1))
    verify = tuple(scale * (1.0 + verify_slope * w) for w in range(max_width + 1))
    try:
        from inference.engine.costs import CostProfile

        return CostProfile(draft, verify, num_rows=num_rows)
    except ImportError:
        from inference.engine.adaptive import CostCurves

        return CostCurves(draft, verify)


def verify_cost(max_width: int, num_rows: int):
    """The scheduler's verify cost, 1e6 seconds per step: a real draft time (ms) cannot tip a decision."""
    try:
        from inference.engine.costs import CostProfile  # noqa: F401

        return costs(max_width, 0.0, 0.3, num_rows=num_rows, scale=1e6)
    except ImportError:
        from inference.engine.schedule import VerifyCost

        return VerifyCost(tuple(num_rows * (w + 1) for w in range(max_width + 1)),
                          tuple(1e6 * (1.0 + 0.3 * w) for w in range(max_width + 1)))


def dump(out) -> dict:
    return {"tokens": out.tokens, "accept_lengths": out.accept_lengths, "proposed": out.proposed,
            "chosen": out.chosen}


def tiny_runs() -> dict:
    results = {}
    for kind in KINDS:
        for temperature in (0.0, 1.0):
            target = tiny_target(vocab_size=None if temperature == 0 else 32)
            for batch, prompts in PROMPTS.items():
                def run(method, sampled=kind in SAMPLING and temperature > 0):
                    drafter = build(kind, target, sampling=sampled)
                    if method == "tree4":
                        return tree_speculative_generate(target, drafter, prompts, tree_budget=4, max_new_tokens=16,
                                                         temperature=temperature, seed=3)
                    options = {}
                    k = 3
                    if method.startswith("k"):
                        k = int(method[1:])
                    elif method == "auto":
                        options["adaptive"] = AdaptiveK(costs(3, 0.1, 0.05), explore_after=2)
                    elif method == "threshold":
                        options["schedule"] = StaticThreshold(0.5)
                    elif method == "scheduler":
                        if hasattr(drafter, "set_confidence_temperatures"):
                            drafter.set_confidence_temperatures([1.0] * 3)
                        options["schedule"] = PrefixScheduler(verify_cost(3, len(prompts)))
                    return speculative_generate(target, drafter, prompts, num_draft_tokens=k, max_new_tokens=16,
                                                temperature=temperature, seed=3, **options)

                for method in ("k0", "k1", "k3", "auto", "threshold", "scheduler", "tree4"):
                    results[f"{kind}/T{temperature:g}/b{batch}/{method}"] = dump(run(method))
    return results


def smollm2_runs() -> dict:
    from drafters import load_drafter
    from inference.engine.target import TargetModel
    from inference.evaluation.prompts import load_questions

    target = TargetModel.from_pretrained("smollm2-135m-instruct")
    _, questions = load_questions("mt_bench", num_prompts=3)
    prompts = []
    for question in questions:
        text = target.tokenizer.apply_chat_template([{"role": "user", "content": question.turns[0]}],
                                                    add_generation_prompt=True, tokenize=False)
        prompts.append(target.tokenizer(text, add_special_tokens=False)["input_ids"])
    results = {}
    for batch in (1, 3):
        for method in ("k1", "k3", "auto"):
            drafter = load_drafter("ngram", target.target_info())
            options = {"adaptive": AdaptiveK(costs(4, 0.01, 0.3))} if method == "auto" else {}
            k = 4 if method == "auto" else int(method[1:])
            outs = [speculative_generate(target, drafter, prompts[i:i + batch], num_draft_tokens=k, max_new_tokens=48,
                                         **options) for i in range(0, len(prompts), batch)]
            results[f"smollm2/ngram/b{batch}/{method}"] = [dump(out) for out in outs]
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--compare", default=None, help="a previous --out to compare with")
    parser.add_argument("--smollm2", action="store_true", help="also the n-gram drafter on smollm2-135m-instruct")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = tiny_runs()
    if args.smollm2:
        results.update(smollm2_runs())
    with open(args.out, "w") as f:
        json.dump(results, f)
    print(f"{len(results)} calls dumped to {args.out}")
    if args.compare:
        with open(args.compare) as f:
            reference = json.load(f)
        differ = sorted(key for key in set(reference) | set(results) if reference.get(key) != results.get(key))
        for key in differ:
            mine, theirs = results.get(key), reference.get(key)
            pairs = zip(mine, theirs) if isinstance(mine, list) and isinstance(theirs, list) else [(mine, theirs)]
            fields = sorted({f for a, b in pairs if a and b for f in a if a[f] != b.get(f)})
            print(f"differs: {key} ({', '.join(fields) if fields else 'missing on one side'})")
        print(f"{len(set(reference) & set(results))} calls compared, {len(differ)} differ")
        return 1 if differ else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
