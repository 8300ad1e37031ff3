"""The engine's own overhead: its verify forward beside the bare HF forward of the same model.

    OMP_NUM_THREADS=1 python benchmarks/engine/engine_overhead.py --target smollm2-135m-instruct --context 300 \\
        --max-k 15 --repeats 7 --out docs/results/engine_overhead.json

After a context of --context tokens, for every k = 0..max_k it times, interleaved (k by k, repeat by repeat, so a
change of machine load hits both alike):
- bare:   `model(input_ids [1, k + 1], cache=cache)` of plain transformers, no attention mask, the cache
          cropped back after each call (untimed);
- engine: the engine's verify round (inference/engine/rounds.verify_chain): the same forward through RaggedLM
          (slot mask, position ids, hidden-state hooks of an EAGLE-3 request), the greedy accept decision and the
          rollback.
Both grow the same cache from the same context. It reports the medians, v(k) = time(k) / time(0) of each, and their
ratio (the goal: the engine's v(k) within 1.1x of the bare model's at every k <= 15). v(k) of the bare model is the
machine's: the GEMMs over k + 1 rows and the 49k-row lm_head grow with k whatever the engine does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import DynamicCache

from drafters.base import FeatureRequest
from inference.engine.rounds import verify_chain
from inference.engine.target import TargetModel, synchronize
from inference.evaluation.environment import environment


def timed(device, fn) -> float:
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


@torch.no_grad()
def measure(target: TargetModel, context: int, max_k: int, repeats: int, request: FeatureRequest) -> dict:
    """Median seconds per k of the bare forward and of the engine's verify round, interleaved."""
    model, device = target.model, target.device
    vocab = target.target_info().vocab_size
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (1, context), generator=generator).to(device)
    bare_cache = DynamicCache(config=model.config)
    cache_arg = target.runner.cache_arg  # `cache` in transformers >= 5.2x, `past_key_values` before
    model(input_ids=prompt, use_cache=True, logits_to_keep=1, **{cache_arg: bare_cache})
    target.prefill(prompt, torch.ones_like(prompt), request)
    blocks = {k: torch.randint(0, vocab, (1, k + 1), generator=generator).to(device) for k in range(max_k + 1)}
    active = torch.ones(1, dtype=torch.bool, device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    bare = {k: [] for k in blocks}
    engine = {k: [] for k in blocks}
    for attempt in range(repeats + 1):  # the first pass warms up
        for k, block in blocks.items():
            bare_time = timed(device, lambda: model(input_ids=block, use_cache=True, **{cache_arg: bare_cache}))
            bare_cache.crop(-(k + 1))  # back to the context
            mark = target.mark()
            num_valid = torch.full((1,), k, dtype=torch.long, device=device)
            engine_time = timed(device, lambda: verify_chain(
                target, block=block, drafts=block[:, 1:], num_valid=num_valid, request=request, active=active,
                generator=gen))
            target.keep_after(mark, torch.zeros(1, dtype=torch.long, device=device))
            if attempt:
                bare[k].append(bare_time)
                engine[k].append(engine_time)
    rows = []
    bare0, engine0 = statistics.median(bare[0]), statistics.median(engine[0])
    for k in blocks:
        b, e = statistics.median(bare[k]), statistics.median(engine[k])
        rows.append({"k": k, "bare_s": b, "engine_s": e, "bare_v": b / bare0, "engine_v": e / engine0,
                     "v_ratio": (e / engine0) / (b / bare0), "engine_over_bare": e / b})
    return {"context": context, "repeats": repeats, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--max-k", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="JSON of the table (printed either way)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else "cpu"
    target = TargetModel.from_pretrained(args.target, device=device)
    num_layers = target.num_layers
    request = FeatureRequest(layer_ids=(2, num_layers // 2, num_layers - 3))  # what an EAGLE-3 drafter asks for
    result = measure(target, args.context, args.max_k, args.repeats, request)
    result["env"] = environment(target.device)
    print("| k | bare ms | engine ms | bare v(k) | engine v(k) | engine v / bare v | engine / bare |")
    print("|---|---|---|---|---|---|---|")
    for row in result["rows"]:
        print(f"| {row['k']} | {1e3 * row['bare_s']:.1f} | {1e3 * row['engine_s']:.1f} | {row['bare_v']:.2f} | "
              f"{row['engine_v']:.2f} | {row['v_ratio']:.3f} | {row['engine_over_bare']:.3f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
