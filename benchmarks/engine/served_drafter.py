"""What serving the drafter on the target's fast path buys: plain decoding, the drafter as loaded (its own F.linear,
its shared head by F.linear) and the same drafter served (`TargetModel.serve`: its linears and its shared head by the
machine's chosen kernels), interleaved prompt by prompt, greedy outputs compared.

    HF_HUB_OFFLINE=1 python benchmarks/engine/served_drafter.py --drafter runs/smollm2_dflash_long/final --k 7 \
        --threads 1 --out docs/results/served_drafter_dflash_t1.json

SmolLM2-135M-Instruct on its fast path with the lean forward, first turns of held-out questions, batch 1, T = 0;
medians over repeats after a warm-up pass. Per row: tokens/s, the draft's milliseconds per round, speedup over plain.
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.measure import write_measurement
from drafters import load_drafter
from inference.engine.cpu import CpuBackend
from inference.engine.generate import decode
from inference.engine.policy import FixedWidth
from inference.engine.rounds import ChainRounds
from inference.engine.target import TargetModel
from inference.evaluation.eval import render_prompt
from inference.evaluation.prompts import load_questions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", required=True, help="a trained drafter directory (runs/.../final)")
    parser.add_argument("--k", type=int, required=True, help="draft tokens per round")
    parser.add_argument("--prompts", default="recipes/smollm2/data/sharegpt_smollm2_10k.heldout.jsonl")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = TargetModel.from_pretrained("smollm2-135m-instruct", backend=CpuBackend())
    info = target.target_info()
    try:
        drafters = {"as loaded": load_drafter(args.drafter, info), "served": target.serve(load_drafter(args.drafter,
                                                                                                      info))}
    except (ValueError, OSError) as err:
        sys.exit(f"--drafter {args.drafter!r}: {err}")
    for drafter in drafters.values():
        drafter.eval()
    _, questions = load_questions(args.prompts, num_prompts=args.num_prompts)
    prompts = [render_prompt(target.tokenizer, q.turns[:1], [], True) for q in questions]
    names = ["plain", *drafters]
    seconds = {name: [] for name in names}
    draft_ms = {name: [] for name in names}
    tokens = {name: [] for name in names}
    for attempt in range(args.repeats + 1):
        for prompt in prompts:
            for name in names:
                drafter = drafters.get(name)
                start = time.perf_counter()
                out = decode(target, drafter, [prompt], ChainRounds(), FixedWidth(args.k if drafter else 0),
                             max_new_tokens=args.max_new_tokens, eos_token_ids=[])
                elapsed = time.perf_counter() - start - out.time_prefill
                if attempt:
                    seconds[name].append(elapsed / len(out.tokens[0]))
                    draft_ms[name].append(1e3 * out.time_draft / out.verify_forwards)
                if attempt == 1:
                    tokens[name].append(out.tokens[0])
    base = statistics.median(seconds["plain"])
    rows = {name: {"tokens_per_s": 1.0 / statistics.median(seconds[name]),
                   "speedup": base / statistics.median(seconds[name]),
                   "draft_ms_per_round": statistics.median(draft_ms[name]),
                   "greedy_equal_plain": tokens[name] == tokens["plain"]} for name in names}
    record = {"drafter": args.drafter, "k": args.k, "threads": args.threads,
              "load_1min": os.getloadavg()[0], "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
              "repeats": args.repeats, "kernels_frozen": getattr(target.drafter_kernels(drafters["served"]), "frozen", None),
              "rows": rows}
    for name, row in rows.items():
        print(f"threads {args.threads} k {args.k} {name}: {row['tokens_per_s']:.2f} tok/s, {row['speedup']:.3f}x, "
              f"draft {row['draft_ms_per_round']:.1f} ms/round, greedy equal {row['greedy_equal_plain']}")
    if args.out:
        write_measurement(args.out, record)


if __name__ == "__main__":
    main()
