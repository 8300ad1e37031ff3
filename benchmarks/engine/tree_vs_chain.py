"""Tree vs. chain verification at equal verify budget, on the embedded default target.

    OMP_NUM_THREADS=1 python benchmarks/engine/tree_vs_chain.py --num-prompts 4 --max-new-tokens 96 --repeats 2 \
        --out docs/results/tree_vs_chain.json

SmolLM2-135M-Instruct, MT-Bench first turns with the chat template, T = 0, batch size 1, one thread. For each trained
drafter and budget B (tokens verified per round, root included): the chain proposes k = B - 1 drafts
(speculative_generate; capped at the drafter's max_draft_tokens, recorded as chain_k), the tree has B nodes
(tree_speculative_generate: EAGLE-2 dynamic tree for EAGLE-3, DDTree over the block's marginals for DFlash and
DSpark). The AR baseline is speculative_generate with k = 0, the same engine. Every repeat runs every configuration
once, in the same order (interleaved, the machine is shared); time-based numbers are medians over repeats, tau is
the same in every repeat at T = 0. Each record is inference/metrics.build_record's plus method, budget, chain_k,
the per-repeat tokens/s and whether the output equals the AR output.
"""

from __future__ import annotations

import argparse
import json

import torch

from drafters import load_drafter
from inference.engine.api import speculative_generate, tree_speculative_generate
from inference.engine.target import TargetModel
from inference.evaluation.environment import environment
from inference.evaluation.eval import render_prompt
from inference.evaluation.metrics import build_record, merge_outputs, tokens_per_second
from inference.evaluation.prompts import load_questions

DRAFTERS = {"eagle3": "runs/bench/E_cold/final", "dflash": "runs/bench/D_dflash/final",
            "dspark": "runs/bench/D_dspark/final"}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--budgets", default="2,4,8,16", help="comma-separated tree budgets B (chain k = B - 1)")
    parser.add_argument("--drafters", default=",".join(DRAFTERS), help=f"a subset of {sorted(DRAFTERS)}")
    parser.add_argument("--tree-top-k", type=int, default=4, help="EAGLE-2 children per node / frontier width")
    parser.add_argument("--checkpoint-root", default=".", help="the directory runs/bench/... lives in")
    parser.add_argument("--out", default="docs/results/tree_vs_chain.json")
    return parser.parse_args(argv)


def configurations(args, target) -> list[tuple[str, str, int, object]]:
    """(drafter name, method, budget, drafter) for every run, the AR baseline first."""
    runs = [("none", "ar", 1, None)]
    for name in args.drafters.split(","):
        if name not in DRAFTERS:
            raise SystemExit(f"--drafters: unknown drafter {name!r}; known: {', '.join(DRAFTERS)}")
        drafter = target.serve(load_drafter(f"{args.checkpoint_root}/{DRAFTERS[name]}", target.target_info()))
        for budget in (int(b) for b in args.budgets.split(",")):
            runs += [(name, "chain", budget, drafter), (name, "tree", budget, drafter)]
    return runs


def run_once(target, drafter, method: str, budget: int, prompts, args):
    """One configuration over every prompt (batch size 1), outputs merged; returns (output, chain k)."""
    outputs, chain_k = [], None
    for prompt in prompts:
        if method == "tree":
            outputs.append(tree_speculative_generate(target, drafter, [prompt], tree_budget=budget,
                                                     max_new_tokens=args.max_new_tokens, eos_token_ids=[],
                                                     tree_top_k=args.tree_top_k))
            continue
        limit = drafter.max_draft_tokens() if drafter is not None else None
        chain_k = 0 if method == "ar" else (budget - 1 if limit is None else min(budget - 1, limit))
        outputs.append(speculative_generate(target, drafter, [prompt], num_draft_tokens=chain_k,
                                            max_new_tokens=args.max_new_tokens, eos_token_ids=[]))
    return merge_outputs(outputs), chain_k


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    target = TargetModel.from_pretrained("smollm2-135m-instruct")
    _, questions = load_questions("mt_bench", args.num_prompts)
    prompts = [render_prompt(target.tokenizer, q.turns[:1], [], use_chat_template=True) for q in questions]
    runs = configurations(args, target)
    speculative_generate(target, None, [prompts[0]], num_draft_tokens=0, max_new_tokens=8)  # warm-up
    results: dict = {}
    for repeat in range(args.repeats):
        for name, method, budget, drafter in runs:
            out, chain_k = run_once(target, drafter, method, budget, prompts, args)
            key = (name, method, budget)
            results.setdefault(key, {"outputs": [], "chain_k": chain_k})["outputs"].append(out)
            print(f"repeat {repeat} {name} {method} B={budget}: {tokens_per_second(out):.2f} tok/s", flush=True)
    env = environment(target.device)
    records = [summarise(key, value, results, len(prompts), env) for key, value in results.items()]
    command = "OMP_NUM_THREADS=1 python benchmarks/engine/tree_vs_chain.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("out", "checkpoint_root"))
    with open(args.out, "w") as f:
        json.dump({"command": command, "env": env, "records": records}, f, indent=2)
    for r in records:
        print(f"{r['drafter']:7s} {r['method']:5s} B={r['budget']:2d} k={r['chain_k']} tau {r['tau']:.2f} "
              f"speedup {r['speedup']:.2f} exact {r['greedy_exact_match']}", flush=True)
    print(f"wrote {args.out}")


def summarise(key, value, results, num_prompts: int, env) -> dict:
    """build_record on the repeat with the median tokens/s, against the AR repeat with the median tokens/s."""
    name, method, budget = key
    by_speed = sorted(value["outputs"], key=tokens_per_second)
    out = by_speed[len(by_speed) // 2]
    ar_runs = sorted(results[("none", "ar", 1)]["outputs"], key=tokens_per_second)
    ar = ar_runs[len(ar_runs) // 2]
    match = sum(a == b for a, b in zip(out.tokens, ar.tokens)) / num_prompts
    record = build_record(out, ar=None if method == "ar" else ar, dataset="mt_bench", category="all",
                          drafter_name=name, temperature=0.0, batch_size=1, num_prompts=num_prompts,
                          greedy_exact_match=match, env=env)
    rates = [tokens_per_second(o) for o in value["outputs"]]
    record.update(method=method, budget=budget, chain_k=value["chain_k"], tokens_per_s_repeats=rates)
    if method == "ar":
        record["speedup"] = 1.0
    return record


if __name__ == "__main__":
    main()
