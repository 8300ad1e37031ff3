"""Engine benchmark on the embedded default target. Writes JSON + a Markdown section.

    python benchmarks/engine/bench_engine.py --num-prompts 4 --repeats 3 --out docs/bench_engine.json

Three parts, all on SmolLM2-135M-Instruct, MT-Bench first turns with the chat template, T = 0, batch size 1:
  A. our autoregressive path (k = 0) vs. HF `generate` greedy;
  B. our engine vs. HF assisted generation with the same target, the same draft model (the target's first layers),
     constant k and confidence threshold 0; the drafts are greedy on both sides, so acceptance is equal;
  C. tau, c, v(k), measured and theoretical speedup for draft_model and ngram at k = 1..8.
A and B interleave the methods inside every repeat (the machine is shared and noisy) and report medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import AutoModelForCausalLM

from drafters import DraftModelDrafter, NgramDrafter
from drafters.draft_model import DraftModelConfig
from inference.assets.store import make_truncated_draft_model, resolve_target
from inference.engine.api import speculative_generate
from inference.engine.target import TargetModel
from inference.evaluation.environment import environment
from inference.evaluation.eval import render_prompt
from inference.evaluation.metrics import build_record, merge_outputs
from inference.evaluation.prompts import load_questions


def encode_prompts(tokenizer, num_prompts: int) -> list[list[int]]:
    _, questions = load_questions("mt_bench", num_prompts)
    return [render_prompt(tokenizer, q.turns[:1], [], use_chat_template=True) for q in questions]


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def hf_generate(model, prompt, max_new_tokens, assistant=None, k=0):
    kwargs = {}
    if assistant is not None:
        kwargs = dict(assistant_model=assistant, num_assistant_tokens=k, num_assistant_tokens_schedule="constant",
                      assistant_confidence_threshold=0.0)
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=None, pad_token_id=0, **kwargs)
    return out[0, len(prompt):].tolist()


def part_ab(target, draft_dir, prompts, args) -> dict:
    """Interleaved repeats of the four methods; per repeat, new tokens / seconds over all prompts."""
    assistant = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
    drafter = DraftModelDrafter(DraftModelConfig(path=draft_dir), target.target_info(), model=assistant)
    k = args.assisted_k
    methods = {
        "ours_ar": lambda p: speculative_generate(target, None, [p], num_draft_tokens=0, max_new_tokens=args.max_new_tokens,
                                                  eos_token_ids=[]).tokens[0],
        "hf_generate": lambda p: hf_generate(target.model, p, args.max_new_tokens),
        "ours_draft_model": lambda p: speculative_generate(target, drafter, [p], num_draft_tokens=k,
                                                           max_new_tokens=args.max_new_tokens, eos_token_ids=[]).tokens[0],
        "hf_assisted": lambda p: hf_generate(target.model, p, args.max_new_tokens, assistant, k),
    }
    rates = {name: [] for name in methods}
    outputs = {}
    for repeat in range(args.repeats):
        for name, fn in methods.items():
            seconds, tokens = timed(lambda: [fn(p) for p in prompts])
            rates[name].append(sum(len(t) for t in tokens) / seconds)
            outputs[name] = tokens
            print(f"repeat {repeat} {name}: {rates[name][-1]:.2f} tok/s", flush=True)
    med = {name: statistics.median(values) for name, values in rates.items()}
    return {
        "tokens_per_s": rates, "median_tokens_per_s": med, "assisted_k": k,
        "ours_ar_vs_hf_generate": med["ours_ar"] / med["hf_generate"],
        "ours_vs_hf_assisted": med["ours_draft_model"] / med["hf_assisted"],
        "outputs_identical": {name: outputs[name] == outputs["ours_ar"] for name in outputs},
    }


def part_c(target, draft_dir, prompts, args, env) -> list[dict]:
    info = target.target_info()
    draft_lm = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
    drafters = {f"draft_model(L{args.draft_layers})": DraftModelDrafter(DraftModelConfig(path=draft_dir), info,
                                                                         model=draft_lm),
                "ngram": NgramDrafter(NgramDrafter.Config(), info)}

    def run(drafter, k):
        return merge_outputs([speculative_generate(target, drafter, [p], num_draft_tokens=k,
                                                   max_new_tokens=args.max_new_tokens) for p in prompts])

    ar = run(None, 0)
    records = []
    for k in args.ks:
        for name, drafter in drafters.items():
            out = run(drafter, k)
            match = sum(a == b for a, b in zip(out.tokens, ar.tokens)) / len(prompts)
            records.append(build_record(out, ar=ar, dataset="mt_bench", category="all", drafter_name=name,
                                        temperature=0.0, batch_size=1, num_prompts=len(prompts),
                                        greedy_exact_match=match, env=env))
            r = records[-1]
            print(f"{name} k={k}: tau {r['tau']:.2f} c {r['draft_cost_ratio']:.3f} v {r['verify_cost_ratio']:.2f} "
                  f"speedup {r['speedup']:.2f} theory {r['theoretical_speedup']:.2f}", flush=True)
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--draft-layers", type=int, default=2)
    parser.add_argument("--assisted-k", type=int, default=4)
    parser.add_argument("--ks", type=lambda s: [int(x) for x in s.split(",")], default=list(range(1, 9)))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--parts", default="ab,c")
    parser.add_argument("--out", default="docs/bench_engine.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target_dir = resolve_target("smollm2-135m-instruct")
    draft_dir = make_truncated_draft_model(target_dir, args.draft_layers,
                                           f"{target_dir}-draft-L{args.draft_layers}")
    target = TargetModel.from_pretrained(target_dir)
    prompts = encode_prompts(target.tokenizer, args.num_prompts)
    env = environment(target.device)
    result = {"command": "python benchmarks/engine/bench_engine.py " + " ".join(
        f"--{k.replace('_', '-')} {v if not isinstance(v, list) else ','.join(map(str, v))}"
        for k, v in vars(args).items() if k != "out"), "env": env}
    speculative_generate(target, None, [prompts[0]], num_draft_tokens=0, max_new_tokens=8)  # warm-up
    if "ab" in args.parts:
        result["ab"] = part_ab(target, draft_dir, prompts, args)
    if "c" in args.parts:
        result["records"] = part_c(target, draft_dir, prompts, args, env)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
