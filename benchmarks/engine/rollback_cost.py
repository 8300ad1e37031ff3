"""Cost per round of the linear-attention state bookkeeping (drafters/ragged_state.py) on a hybrid target.

    OMP_NUM_THREADS=1 python benchmarks/engine/rollback_cost.py [--repeats 7] [--out docs/results/rollback_cost.json]

One round = what the engine does per verify: mark, a forward over k + 1 tokens per row after each row's sequence, and
keep_after with rows keeping different counts. Three variants, interleaved round by round in one process:
- none:     transformers' forward as is (the block in one chunked gated-delta-rule call) and no state rollback; the
            time floor, and wrong output after any rejection (what the engine cannot do);
- snapshot: the engine's default: the block stepped one position at a time, the state after each kept, each row's
            copied back;
- rerun:    the block in one chunked call, then the state restored and the kept prefix stepped again.
Two shapes: the hybrid debug target `debug:tiny-qwen3.5` (4 layers, hidden 64) and real-width Qwen3.5-27B layers
(hidden 5120, MLP 17408): one gated-DeltaNet layer (16 key / 48 value heads of 128, conv kernel 4) and one full
attention layer (24 heads of 256, 4 KV heads), random weights, fp32, after a 64-token (real width: 16-token)
prefill. Prints the median seconds per round and the ratios to `none`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from drafters.ragged_lm import RaggedLM  # noqa: E402

VARIANTS = ("none", "snapshot", "rerun")
PROMPT_TOKENS = {"tiny-qwen3.5": 64, "qwen3.5-27b-layer": 16}  # the prefill is not timed; short at real width
REAL_WIDTH = dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=2, num_attention_heads=24,
                  num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48,
                  linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                  layer_types=["linear_attention", "full_attention"], vocab_size=1024)


def build(shape: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    if shape == "tiny-qwen3.5":
        from inference.assets.store import resolve_target

        return AutoModelForCausalLM.from_pretrained(resolve_target("debug:tiny-qwen3.5"), dtype=torch.float32).eval()
    config = AutoConfig.for_model("qwen3_5_text", **REAL_WIDTH)
    return AutoModelForCausalLM.from_config(config).float().eval()


def runner_for(model, variant: str) -> RaggedLM:
    runner = RaggedLM(model)
    if variant == "none":  # no recording and no state rollback: the forward as transformers runs it
        runner.family.begin_block = lambda *args, **kwargs: None
        runner.family.keep_states = lambda *args, **kwargs: None
    return runner


def one_round(runner: RaggedLM, variant: str, block: torch.Tensor, keep: torch.Tensor) -> float:
    for recorder in runner.family.recorders.values():  # the recorders belong to the model, shared by the runners
        recorder.mechanism = "rerun" if variant == "rerun" else "snapshot"
    start = time.perf_counter()
    mark = runner.mark()
    runner.extend(block, logits_to_keep=block.shape[1])
    runner.keep_after(mark, keep)
    return time.perf_counter() - start


@torch.no_grad()
def measure(shape: str, batch: int, k: int, repeats: int, rounds: int) -> dict:
    model = build(shape)
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (batch, PROMPT_TOKENS[shape]), generator=generator)
    runners = {variant: runner_for(model, variant) for variant in VARIANTS}
    times: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    for _ in range(repeats):
        for runner in runners.values():
            runner.reset()
            runner.extend(prompt, logits_to_keep=1)
        for _ in range(rounds):
            block = torch.randint(0, vocab, (batch, k + 1), generator=generator)
            keep = torch.randint(1, k + 2, (batch,), generator=generator)
            for variant, runner in runners.items():  # interleaved: a change of load hits every variant alike
                times[variant].append(one_round(runner, variant, block, keep))
    medians = {variant: statistics.median(values) for variant, values in times.items()}
    return {"shape": shape, "batch": batch, "k": k, "median_seconds": medians,
            "ratio_to_none": {variant: medians[variant] / medians["none"] for variant in VARIANTS}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    results = []
    print(f"threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.1f}")
    print("| shape | batch | k | none (ms) | snapshot (ms) | rerun (ms) | snapshot / none | rerun / none |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for shape in ("tiny-qwen3.5", "qwen3.5-27b-layer"):
        for batch, k in ((1, 3), (4, 3), (1, 7)):
            row = measure(shape, batch, k, args.repeats, args.rounds)
            results.append(row)
            m, r = row["median_seconds"], row["ratio_to_none"]
            print(f"| {shape} | {batch} | {k} | {1e3 * m['none']:.2f} | {1e3 * m['snapshot']:.2f} | "
                  f"{1e3 * m['rerun']:.2f} | {r['snapshot']:.2f} | {r['rerun']:.2f} |", flush=True)
    print(f"load after {os.getloadavg()[0]:.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
